//! The same messages on the HTTP/2 bodies of tonic's channel (the agent's end of the
//! agent link): packets sent as a request body whose DATA payloads are slices of the
//! packets, and packets read from the response body's DATA frames without tonic's
//! codec, so nothing keeps a buffer the size of the largest packet a long-lived stream
//! carried.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body::{Body, Frame};
use tether_proto::Packet;
use tonic::{Code, Status};

use super::{frame_parts, Messages};

/// A stream of packets as an HTTP/2 request body: each packet one gRPC message.
pub struct PacketBody<S> {
    packets: S,
    /// The payload of the message whose head went last.
    tail: Option<Bytes>,
    ended: bool,
}

impl<S> PacketBody<S> {
    /// A request body.
    pub fn request(packets: S) -> Self {
        PacketBody {
            packets,
            tail: None,
            ended: false,
        }
    }
}

impl<S: Stream<Item = Packet> + Unpin> Body for PacketBody<S> {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if let Some(tail) = this.tail.take() {
            return Poll::Ready(Some(Ok(Frame::data(tail))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        match ready!(this.packets.poll_next_unpin(cx)) {
            Some(packet) => {
                let (head, tail) = frame_parts(&packet);
                this.tail = tail;
                Poll::Ready(Some(Ok(Frame::data(head))))
            }
            None => {
                this.ended = true;
                Poll::Ready(None)
            }
        }
    }
}

/// Packets read off an HTTP/2 body.
pub struct BodyPackets<B> {
    body: Pin<Box<B>>,
    messages: Messages,
}

impl<B: Body<Data = Bytes, Error = Status>> BodyPackets<B> {
    /// Reads `body`.
    pub fn new(body: B) -> Self {
        BodyPackets {
            body: Box::pin(body),
            messages: Messages::default(),
        }
    }

    /// The next packet; `None` at the end of the body (or trailers saying OK); the
    /// trailers' status when it is not OK; `Internal` for a message that is not a
    /// packet or a body that ends inside one.
    pub async fn message(&mut self) -> Result<Option<Packet>, Status> {
        loop {
            match self.messages.next_packet() {
                Ok(Some(packet)) => return Ok(Some(packet)),
                Ok(None) => {}
                Err(why) => return Err(Status::internal(why.to_string())),
            }
            let frame = std::future::poll_fn(|cx| self.body.as_mut().poll_frame(cx)).await;
            match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => self.messages.push(data),
                    Err(frame) => {
                        let status = frame
                            .trailers_ref()
                            .and_then(Status::from_header_map)
                            .filter(|s| s.code() != Code::Ok);
                        return status.map_or(Ok(None), Err);
                    }
                },
                Some(Err(status)) => return Err(status),
                None if self.messages.mid_message() => {
                    return Err(Status::internal("the stream ended inside a message"))
                }
                None => return Ok(None),
            }
        }
    }
}
