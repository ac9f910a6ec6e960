//! `write_through!`: the `AsyncWrite` impl of a reader wrapper whose writes go straight
//! to the wrapped stream (vectored writes included).

/// Implements `tokio::io::AsyncWrite` for `$ty<IO>` by forwarding every call to its
/// field `$field: IO`.
#[macro_export]
macro_rules! write_through {
    ($ty:ident, $field:ident) => {
        impl<IO: ::tokio::io::AsyncWrite + Unpin> ::tokio::io::AsyncWrite for $ty<IO> {
            fn poll_write(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                buf: &[u8],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::tokio::io::AsyncWrite::poll_write(
                    ::std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                    buf,
                )
            }

            fn poll_write_vectored(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
                bufs: &[::std::io::IoSlice<'_>],
            ) -> ::std::task::Poll<::std::io::Result<usize>> {
                ::tokio::io::AsyncWrite::poll_write_vectored(
                    ::std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                    bufs,
                )
            }

            fn is_write_vectored(&self) -> bool {
                ::tokio::io::AsyncWrite::is_write_vectored(&self.$field)
            }

            fn poll_flush(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::tokio::io::AsyncWrite::poll_flush(
                    ::std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                )
            }

            fn poll_shutdown(
                self: ::std::pin::Pin<&mut Self>,
                cx: &mut ::std::task::Context<'_>,
            ) -> ::std::task::Poll<::std::io::Result<()>> {
                ::tokio::io::AsyncWrite::poll_shutdown(
                    ::std::pin::Pin::new(&mut self.get_mut().$field),
                    cx,
                )
            }
        }
    };
}
