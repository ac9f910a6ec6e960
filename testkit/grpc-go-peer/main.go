// Command tether-grpc-go-peer is a test double for the upstream Konnectivity agent and
// server on the agent link. It speaks /AgentService/Connect through grpc-go as
// vendored in Kubernetes 1.20 (v1.27.1), with the options upstream's proxy-agent and
// proxy-server pass to grpc-go (keepalive, the server's ping policy, mutual TLS), so
// that Tether's server and agent are tested against grpc-go's HTTP/2 and gRPC and not
// only against each other. It is ours, not upstream's code; only the wire behaviour
// follows upstream.
//
//	tether-grpc-go-peer agent  --server HOST:PORT --ca F --cert F --key F --agent-id ID ...
//	tether-grpc-go-peer server --ca F --cert F --key F --target HOST:PORT ...
//
// Both write JSON lines ({"message": ..., fields}) to stderr, which the Rust tests
// wait on. The server mode's "frontend" is a plain TCP listener: every connection to
// it is dialled through the connected agent to --target, as a port forward.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io/ioutil"
	"math/rand"
	"net"
	"os"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"sigs.k8s.io/apiserver-network-proxy/konnectivity-client/proto/client"
)

const connectMethod = "/AgentService/Connect"

var connectDesc = grpc.StreamDesc{StreamName: "Connect", ServerStreams: true, ClientStreams: true}

// Packet types newer than the vendored proto (v0.0.14).
const (
	packetDialClose client.PacketType = 5
	packetDrain     client.PacketType = 6
)

// readSize is how much one DATA packet carries at most, as upstream's agent reads.
const readSize = 32 << 10

// queueSize is the per-connection queue of packets to write (upstream's
// --xfr-channel-size default for the agent).
const queueSize = 150

var logMu sync.Mutex

// logEvent writes one JSON line to stderr.
func logEvent(message string, kv ...interface{}) {
	m := map[string]interface{}{"message": message}
	for i := 0; i+1 < len(kv); i += 2 {
		m[fmt.Sprint(kv[i])] = kv[i+1]
	}
	line, _ := json.Marshal(m)
	logMu.Lock()
	os.Stderr.Write(append(line, '\n'))
	logMu.Unlock()
}

func fatal(format string, args ...interface{}) {
	logEvent("fatal", "error", fmt.Sprintf(format, args...))
	os.Exit(2)
}

func main() {
	if len(os.Args) < 2 {
		fatal("usage: tether-grpc-go-peer agent|server [flags]")
	}
	switch os.Args[1] {
	case "agent":
		runAgent(os.Args[2:])
	case "server":
		runServer(os.Args[2:])
	default:
		fatal("unknown mode %q (agent or server)", os.Args[1])
	}
}

func certPool(path string) *x509.CertPool {
	pem, err := ioutil.ReadFile(path)
	if err != nil {
		fatal("read CA %s: %v", path, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		fatal("no certificate in %s", path)
	}
	return pool
}

func keyPair(cert, key string) tls.Certificate {
	pair, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		fatal("load %s / %s: %v", cert, key, err)
	}
	return pair
}

// sender serializes SendMsg on one stream, as grpc-go requires.
type sender struct {
	mu     sync.Mutex
	stream grpc.Stream
}

func (s *sender) send(p *client.Packet) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stream.SendMsg(p)
}

// pipe is one proxied TCP connection: packets from the stream are queued and written
// by a goroutine of their own, so a slow socket holds up only itself.
type pipe struct {
	conn   net.Conn
	queue  chan []byte
	mu     sync.Mutex
	closed bool
}

func newPipe(conn net.Conn) *pipe {
	p := &pipe{conn: conn, queue: make(chan []byte, queueSize)}
	go func() {
		for data := range p.queue {
			if _, err := conn.Write(data); err != nil {
				break
			}
		}
		conn.Close()
		for range p.queue {
		}
	}()
	return p
}

// push queues data for the writer; data for a finished pipe is dropped.
func (p *pipe) push(data []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.queue <- data
	}
}

// finish stops the writer once what is queued has been written.
func (p *pipe) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.closed {
		p.closed = true
		close(p.queue)
	}
}

// pump sends what conn reads as DATA packets for id until it fails, then calls done.
func pump(conn net.Conn, id int64, s *sender, done func(error)) {
	buf := make([]byte, readSize)
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			data := append([]byte(nil), buf[:n]...)
			pkt := &client.Packet{Type: client.PacketType_DATA,
				Payload: &client.Packet_Data{Data: &client.Data{ConnectID: id, Data: data}}}
			if serr := s.send(pkt); serr != nil {
				done(serr)
				return
			}
		}
		if err != nil {
			done(err)
			return
		}
	}
}

// table is a concurrent map of connection id to pipe.
type table struct {
	mu    sync.Mutex
	pipes map[int64]*pipe
}

func newTable() *table { return &table{pipes: map[int64]*pipe{}} }

func (t *table) put(id int64, p *pipe) {
	t.mu.Lock()
	t.pipes[id] = p
	t.mu.Unlock()
}

func (t *table) get(id int64) *pipe {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.pipes[id]
}

// take removes and returns the pipe of id, or nil if it is already gone.
func (t *table) take(id int64) *pipe {
	t.mu.Lock()
	defer t.mu.Unlock()
	p := t.pipes[id]
	delete(t.pipes, id)
	return p
}

func (t *table) drain() []*pipe {
	t.mu.Lock()
	defer t.mu.Unlock()
	var all []*pipe
	for id, p := range t.pipes {
		all = append(all, p)
		delete(t.pipes, id)
	}
	return all
}

func (t *table) len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.pipes)
}

// ---- agent ----

func runAgent(args []string) {
	fs := flag.NewFlagSet("agent", flag.ExitOnError)
	server := fs.String("server", "", "proxy server agent address host:port")
	ca := fs.String("ca", "", "CA certificate the server's certificate must chain to")
	cert := fs.String("cert", "", "agent client certificate")
	key := fs.String("key", "", "agent client key")
	agentID := fs.String("agent-id", "grpc-go-agent", "agentID metadata")
	identifiers := fs.String("agent-identifiers", "", "agentIdentifiers metadata")
	ka := fs.Duration("keepalive-time", time.Hour, "grpc-go client keepalive time")
	fs.Parse(args)
	if *server == "" || *ca == "" || *cert == "" || *key == "" {
		fatal("agent needs --server, --ca, --cert and --key")
	}
	host, _, err := net.SplitHostPort(*server)
	if err != nil {
		fatal("--server %q: %v", *server, err)
	}
	cfg := &tls.Config{RootCAs: certPool(*ca), Certificates: []tls.Certificate{keyPair(*cert, *key)},
		ServerName: host, MinVersion: tls.VersionTLS12}
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(credentials.NewTLS(cfg)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: *ka, PermitWithoutStream: true}),
	}
	backoff := 100 * time.Millisecond
	for {
		err := agentSession(*server, opts, *agentID, *identifiers)
		logEvent("stream ended", "error", fmt.Sprint(err))
		time.Sleep(backoff + time.Duration(rand.Int63n(int64(backoff)/10+1)))
		if backoff < time.Second {
			backoff = backoff * 3 / 2
		}
	}
}

// agentSession serves one Connect stream until it fails.
func agentSession(server string, opts []grpc.DialOption, agentID, identifiers string) error {
	conn, err := grpc.Dial(server, opts...)
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(context.Background(),
		"agentID", agentID, "agentIdentifiers", identifiers))
	defer cancel()
	stream, err := conn.NewStream(ctx, &connectDesc, connectMethod)
	if err != nil {
		return err
	}
	md, err := stream.Header()
	if err != nil {
		return err
	}
	logEvent("connected", "serverID", first(md, "serverID"), "serverCount", first(md, "serverCount"))
	s := &sender{stream: stream}
	conns := newTable()
	defer func() {
		for _, p := range conns.drain() {
			p.finish()
		}
	}()
	var nextID int64
	for {
		pkt := new(client.Packet)
		if err := stream.RecvMsg(pkt); err != nil {
			return err
		}
		switch pkt.Type {
		case client.PacketType_DIAL_REQ:
			req := pkt.GetDialRequest()
			go agentDial(req, atomic.AddInt64(&nextID, 1), s, conns)
		case client.PacketType_DATA:
			d := pkt.GetData()
			if p := conns.get(d.ConnectID); p != nil {
				p.push(d.Data)
			}
		case client.PacketType_CLOSE_REQ:
			id := pkt.GetCloseRequest().ConnectID
			if p := conns.take(id); p != nil {
				p.finish()
			}
			s.send(closeResponse(id))
		default:
			logEvent("ignored packet", "type", int32(pkt.Type))
		}
	}
}

func agentDial(req *client.DialRequest, id int64, s *sender, conns *table) {
	rsp := &client.DialResponse{Random: req.Random}
	conn, err := net.DialTimeout(req.Protocol, req.Address, 5*time.Second)
	if err != nil {
		rsp.Error = err.Error()
		s.send(&client.Packet{Type: client.PacketType_DIAL_RSP, Payload: &client.Packet_DialResponse{DialResponse: rsp}})
		logEvent("dial failed", "address", req.Address, "error", err.Error())
		return
	}
	rsp.ConnectID = id
	p := newPipe(conn)
	conns.put(id, p)
	if s.send(&client.Packet{Type: client.PacketType_DIAL_RSP, Payload: &client.Packet_DialResponse{DialResponse: rsp}}) != nil {
		return
	}
	pump(conn, id, s, func(error) {
		// The target closed or failed: tell the server, unless it closed first.
		if p := conns.take(id); p != nil {
			p.finish()
			s.send(closeResponse(id))
		}
	})
}

func closeResponse(id int64) *client.Packet {
	return &client.Packet{Type: client.PacketType_CLOSE_RSP,
		Payload: &client.Packet_CloseResponse{CloseResponse: &client.CloseResponse{ConnectID: id}}}
}

func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// ---- server ----

// backend is one connected agent stream.
type backend struct {
	id      string
	s       *sender
	conns   *table
	mu      sync.Mutex
	pending map[int64]chan *client.DialResponse
}

type proxyServer struct {
	serverID    string
	serverCount int
	mu          sync.Mutex
	backends    []*backend
}

func runServer(args []string) {
	fs := flag.NewFlagSet("server", flag.ExitOnError)
	agentListen := fs.String("agent-listen", "127.0.0.1:0", "agent listener address")
	frontListen := fs.String("frontend-listen", "127.0.0.1:0", "plain TCP port-forward listener")
	ca := fs.String("ca", "", "CA agents' client certificates must chain to")
	cert := fs.String("cert", "", "server certificate")
	key := fs.String("key", "", "server key")
	serverID := fs.String("server-id", "grpc-go-server", "serverID response header")
	serverCount := fs.Int("server-count", 1, "serverCount response header")
	ka := fs.Duration("keepalive-time", time.Hour, "grpc-go server keepalive time")
	minPing := fs.Duration("min-ping-interval", 30*time.Second, "grpc-go ping policy: pings more often are strikes (upstream: 30s)")
	target := fs.String("target", "", "where every frontend connection is dialled, through the agent")
	fs.Parse(args)
	if *ca == "" || *cert == "" || *key == "" || *target == "" {
		fatal("server needs --ca, --cert, --key and --target")
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{keyPair(*cert, *key)}, ClientCAs: certPool(*ca),
		ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
	gs := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(cfg)),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: *ka}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: *minPing, PermitWithoutStream: true}),
	)
	ps := &proxyServer{serverID: *serverID, serverCount: *serverCount}
	gs.RegisterService(&grpc.ServiceDesc{
		ServiceName: "AgentService",
		HandlerType: (*interface{})(nil),
		Streams: []grpc.StreamDesc{{StreamName: "Connect", ServerStreams: true, ClientStreams: true,
			Handler: func(_ interface{}, stream grpc.ServerStream) error { return ps.connect(stream) }}},
	}, ps)
	agentLis, err := net.Listen("tcp", *agentListen)
	if err != nil {
		fatal("listen %s: %v", *agentListen, err)
	}
	frontLis, err := net.Listen("tcp", *frontListen)
	if err != nil {
		fatal("listen %s: %v", *frontListen, err)
	}
	go func() {
		for {
			c, err := frontLis.Accept()
			if err != nil {
				fatal("accept: %v", err)
			}
			go ps.forward(c, *target)
		}
	}()
	logEvent("listening", "agent", agentLis.Addr().String(), "frontend", frontLis.Addr().String())
	if err := gs.Serve(agentLis); err != nil {
		fatal("serve: %v", err)
	}
}

// connect serves one agent's Connect stream.
func (ps *proxyServer) connect(stream grpc.ServerStream) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	hdr := metadata.Pairs("serverID", ps.serverID, "serverCount", strconv.Itoa(ps.serverCount))
	if err := stream.SendHeader(hdr); err != nil {
		return err
	}
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	b := &backend{id: first(md, "agentID"), s: &sender{stream: stream}, conns: newTable(),
		pending: map[int64]chan *client.DialResponse{}}
	ps.mu.Lock()
	ps.backends = append(ps.backends, b)
	ps.mu.Unlock()
	logEvent("agent connected", "agentID", b.id, "agentIdentifiers", first(md, "agentIdentifiers"),
		"metadata", keys)
	err := b.serve(stream)
	ps.mu.Lock()
	for i, x := range ps.backends {
		if x == b {
			ps.backends = append(ps.backends[:i], ps.backends[i+1:]...)
			break
		}
	}
	ps.mu.Unlock()
	for _, p := range b.conns.drain() {
		p.finish()
	}
	logEvent("agent disconnected", "agentID", b.id, "error", fmt.Sprint(err))
	return err
}

func (b *backend) serve(stream grpc.ServerStream) error {
	for {
		pkt := new(client.Packet)
		if err := stream.RecvMsg(pkt); err != nil {
			return err
		}
		switch pkt.Type {
		case client.PacketType_DIAL_RSP:
			rsp := pkt.GetDialResponse()
			b.mu.Lock()
			ch := b.pending[rsp.Random]
			delete(b.pending, rsp.Random)
			b.mu.Unlock()
			if ch != nil {
				ch <- rsp
			}
		case client.PacketType_DATA:
			d := pkt.GetData()
			if p := b.conns.get(d.ConnectID); p != nil {
				p.push(d.Data)
			}
		case client.PacketType_CLOSE_RSP:
			if p := b.conns.take(pkt.GetCloseResponse().ConnectID); p != nil {
				p.finish()
			}
		case packetDrain:
			logEvent("agent draining", "agentID", b.id)
		default:
			logEvent("ignored packet", "type", int32(pkt.Type))
		}
	}
}

// forward dials target through the newest agent and relays c over it.
func (ps *proxyServer) forward(c net.Conn, target string) {
	ps.mu.Lock()
	var b *backend
	if n := len(ps.backends); n > 0 {
		b = ps.backends[n-1]
	}
	ps.mu.Unlock()
	if b == nil {
		logEvent("dial failed", "error", "no agent connected")
		c.Close()
		return
	}
	random := rand.Int63()
	ch := make(chan *client.DialResponse, 1)
	b.mu.Lock()
	b.pending[random] = ch
	b.mu.Unlock()
	req := &client.Packet{Type: client.PacketType_DIAL_REQ, Payload: &client.Packet_DialRequest{
		DialRequest: &client.DialRequest{Protocol: "tcp", Address: target, Random: random}}}
	var rsp *client.DialResponse
	err := b.s.send(req)
	if err == nil {
		select {
		case rsp = <-ch:
			if rsp.Error != "" {
				err = errors.New(rsp.Error)
			}
		case <-time.After(10 * time.Second):
			err = errors.New("no DIAL_RSP within 10s")
		}
	}
	if err != nil {
		logEvent("dial failed", "error", err.Error())
		c.Close()
		return
	}
	id := rsp.ConnectID
	b.conns.put(id, newPipe(c))
	logEvent("tunnel open", "connectID", id, "open", b.conns.len())
	pump(c, id, b.s, func(error) {
		// The client closed: ask the agent to close; its CLOSE_RSP closes our side.
		b.s.send(&client.Packet{Type: client.PacketType_CLOSE_REQ, Payload: &client.Packet_CloseRequest{
			CloseRequest: &client.CloseRequest{ConnectID: id}}})
	})
}
