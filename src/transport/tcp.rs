//! TCP links between ranks on different hosts (or on one host with
//! `OXCCL_TRANSPORT=tcp`).
//!
//! Set-up: every rank listens on an ephemeral port of the interface chosen
//! by `OXCCL_SOCKET_IFNAME` and publishes `addr:port` at rendezvous. For each
//! pair that uses TCP the higher rank connects to the lower one and presents
//! a handshake: magic, protocol version, the job's 16-byte token (derived at
//! rendezvous), its own rank and the rank it wants. The acceptor answers only
//! a handshake with the right token and an expected rank; anything else (a
//! port scanner, another job, a stray process) is logged and closed, and can
//! never place data into a collective. Accepting multiplexes all pending
//! connections without blocking, so a stray connection that sends nothing
//! cannot stall the real ones.
//!
//! Once connected a link is a non-blocking byte stream; frames are laid on
//! it by [`super::net`].

use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// A job's shared secret: links presenting another token are refused.
pub(crate) type Token = [u8; 16];

const HELLO_MAGIC: u32 = 0x5348_584f; // "OXHS"
const ACK_MAGIC: u32 = 0x4b4f_584f; // "OXOK"
const PROTOCOL_VERSION: u32 = 1;
const HELLO_BYTES: usize = 32;

/// Socket buffer size asked for on every link where the kernel allows it
/// ([`buffer_options`]): a ring step's piece should not wait for the
/// receiver to wake up.
const SOCKET_BUFFER_BYTES: libc::c_int = 4 << 20;

fn hello(token: &Token, from: usize, to: usize) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[0..4].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[4..8].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    b[8..24].copy_from_slice(token);
    b[24..28].copy_from_slice(&(from as u32).to_le_bytes());
    b[28..32].copy_from_slice(&(to as u32).to_le_bytes());
    b
}

/// Why a handshake was refused (logged by the acceptor).
fn check_hello(
    b: &[u8; HELLO_BYTES],
    token: &Token,
    me: usize,
    expected: &[usize],
) -> Result<usize, String> {
    let word = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    if word(0) != HELLO_MAGIC {
        return Err("not an oxccl handshake".into());
    }
    if word(4) != PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} (this build speaks {PROTOCOL_VERSION})",
            word(4)
        ));
    }
    if b[8..24] != token[..] {
        return Err("wrong job token (a process of another job?)".into());
    }
    let (from, to) = (word(24) as usize, word(28) as usize);
    if to != me {
        return Err(format!("it asked for rank {to}, this is rank {me}"));
    }
    if !expected.contains(&from) {
        return Err(format!("rank {from} is not expected to connect here"));
    }
    Ok(from)
}

/// The socket buffer options worth setting here: one the kernel would cap
/// below [`SOCKET_BUFFER_BYTES`] (`net.core.{w,r}mem_max`, 208 KiB by
/// default) is left alone, since setting it at all turns off the kernel's
/// autotuning, which may grow the buffer to `net.ipv4.tcp_{w,r}mem`'s
/// maximum (4–6 MiB by default) on a link that needs it.
fn buffer_options() -> &'static [libc::c_int] {
    static OPTIONS: std::sync::OnceLock<Vec<libc::c_int>> = std::sync::OnceLock::new();
    OPTIONS.get_or_init(|| {
        let allows = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|v| v.trim().parse::<i64>().ok())
                .is_some_and(|max| max >= i64::from(SOCKET_BUFFER_BYTES))
        };
        [
            (libc::SO_SNDBUF, "/proc/sys/net/core/wmem_max"),
            (libc::SO_RCVBUF, "/proc/sys/net/core/rmem_max"),
        ]
        .into_iter()
        .filter(|&(_, path)| allows(path))
        .map(|(opt, _)| opt)
        .collect()
    })
}

/// Makes a link fast and non-blocking.
fn tune(stream: &TcpStream) -> io::Result<()> {
    stream.set_nodelay(true)?;
    for &opt in buffer_options() {
        // SAFETY: setsockopt with a valid fd and a c_int option value.
        // Failure only leaves the kernel's default size, so it is ignored.
        unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                &SOCKET_BUFFER_BYTES as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    stream.set_nonblocking(true)
}

/// Connects to rank `to` at `addr` as rank `from`, retrying refused
/// connections until `deadline`, and waits for the acceptor's answer.
pub(crate) fn connect(
    addr: SocketAddr,
    token: &Token,
    from: usize,
    to: usize,
    deadline: Instant,
) -> Result<TcpStream, String> {
    let mut last_error = String::from("no attempt made");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("could not connect to {addr}: {last_error}"));
        }
        match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
            Ok(mut stream) => {
                // What is left now: the connection itself may have taken
                // up to 5 s of it.
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(format!(
                        "connected to rank {to} at {addr} only as the deadline passed"
                    ));
                }
                let answer = (|| {
                    stream.set_write_timeout(Some(left))?;
                    stream.write_all(&hello(token, from, to))?;
                    stream.set_read_timeout(Some(left))?;
                    let mut ack = [0u8; 4];
                    stream.read_exact(&mut ack)?;
                    Ok::<_, io::Error>(u32::from_le_bytes(ack))
                })();
                return match answer {
                    Ok(ACK_MAGIC) => {
                        tune(&stream).map_err(|e| format!("configuring the link: {e}"))?;
                        Ok(stream)
                    }
                    Ok(_) => Err(format!("{addr} is not an oxccl rank (bad answer)")),
                    Err(e) => Err(format!(
                        "rank {to} at {addr} refused the handshake or did not answer ({e}); \
                         is it a rank of this job?"
                    )),
                };
            }
            Err(e) => {
                last_error = e.to_string();
                std::thread::sleep(Duration::from_millis(20).min(left));
            }
        }
    }
}

/// A connection accepted but not yet verified.
struct Pending {
    stream: TcpStream,
    from_addr: SocketAddr,
    hello: [u8; HELLO_BYTES],
    filled: usize,
    accepted_at: Instant,
}

/// How long an accepted connection may take to send its hello: a rank
/// writes it as soon as it has connected, so only a stranger (a port
/// scanner, a half-open connection) waits longer, and it must not hold a
/// descriptor until the set-up's deadline.
const HELLO_PATIENCE: Duration = Duration::from_secs(5);
/// Connections kept waiting for their hello at once; past it the listener
/// takes no more until some are verified or refused (the rest wait in the
/// kernel's backlog), so strangers cannot use up the descriptors the ranks
/// need, and a rank's connection is never refused for the crowd.
const MAX_PENDING: usize = 256;

/// Accepts one verified connection from each rank in `expected`, refusing
/// (and logging) anything else, until `deadline`. On expiry returns the
/// ranks that never connected.
pub(crate) fn accept(
    listener: &TcpListener,
    token: &Token,
    me: usize,
    expected: &[usize],
    deadline: Instant,
) -> Result<HashMap<usize, TcpStream>, Vec<usize>> {
    let mut done: HashMap<usize, TcpStream> = HashMap::new();
    let mut pending: Vec<Pending> = Vec::new();
    // The listener's own failures (EMFILE: out of descriptors) are told
    // once each: the timeout that may follow names only missing ranks.
    let mut told: Option<ErrorKind> = None;
    if listener.set_nonblocking(true).is_err() {
        return Err(expected.to_vec());
    }
    while done.len() < expected.len() {
        let mut progressed = false;
        while pending.len() < MAX_PENDING {
            match listener.accept() {
                Ok((stream, from_addr)) => {
                    progressed = true;
                    if stream.set_nonblocking(true).is_ok() {
                        pending.push(Pending {
                            stream,
                            from_addr,
                            hello: [0; HELLO_BYTES],
                            filled: 0,
                            accepted_at: Instant::now(),
                        });
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // The peer gave up before we took its connection.
                Err(e) if e.kind() == ErrorKind::ConnectionAborted => break,
                Err(e) => {
                    if told != Some(e.kind()) {
                        eprintln!("oxccl: rank {me}: accepting peers' connections: {e}");
                        told = Some(e.kind());
                    }
                    break;
                }
            }
        }
        let mut i = 0;
        while i < pending.len() {
            let p = &mut pending[i];
            let outcome = match p.stream.read(&mut p.hello[p.filled..]) {
                Ok(0) => Some(Err("closed before completing the handshake".to_string())),
                Ok(n) => {
                    progressed = true;
                    p.filled += n;
                    (p.filled == HELLO_BYTES).then(|| {
                        let remaining: Vec<usize> = expected
                            .iter()
                            .copied()
                            .filter(|r| !done.contains_key(r))
                            .collect();
                        check_hello(&p.hello, token, me, &remaining)
                    })
                }
                Err(e)
                    if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted =>
                {
                    (p.accepted_at.elapsed() >= HELLO_PATIENCE).then(|| {
                        Err(format!(
                            "it sent no complete hello within {HELLO_PATIENCE:?}"
                        ))
                    })
                }
                Err(e) => Some(Err(e.to_string())),
            };
            match outcome {
                None => i += 1,
                Some(result) => {
                    let p = pending.swap_remove(i);
                    match result {
                        Ok(from) => match acknowledge(p.stream, deadline) {
                            Ok(stream) => {
                                done.insert(from, stream);
                            }
                            Err(e) => log_refusal(me, p.from_addr, &format!("ack failed: {e}")),
                        },
                        Err(why) => log_refusal(me, p.from_addr, &why),
                    }
                }
            }
        }
        if done.len() == expected.len() {
            for p in &pending {
                log_refusal(me, p.from_addr, "it did not complete a handshake");
            }
            break;
        }
        if Instant::now() >= deadline {
            return Err(expected
                .iter()
                .copied()
                .filter(|r| !done.contains_key(r))
                .collect());
        }
        if !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(done)
}

/// Answers a verified hello. The link is configured first: a failure then
/// refuses the connection before the peer hears an answer (it retries or
/// times out naming this rank), where after the answer the peer would go
/// on with a link this side dropped. The answer waits at most 5 s, and not
/// past the set-up's deadline.
fn acknowledge(mut stream: TcpStream, deadline: Instant) -> io::Result<TcpStream> {
    tune(&stream)?;
    let left = deadline
        .saturating_duration_since(Instant::now())
        .clamp(Duration::from_millis(1), Duration::from_secs(5));
    stream.set_nonblocking(false)?;
    stream.set_write_timeout(Some(left))?;
    stream.write_all(&ACK_MAGIC.to_le_bytes())?;
    // Back to what `tune` left: links are non-blocking.
    stream.set_nonblocking(true)?;
    Ok(stream)
}

fn log_refusal(me: usize, from: SocketAddr, why: &str) {
    eprintln!("oxccl: rank {me}: refused a connection from {from}: {why}");
}

/// Bytes a link reads at once when asked for fewer (a frame header): the
/// header and a small payload behind it then arrive in one system call
/// (about 2 µs each on the VMs measured) instead of two. Larger reads
/// bypass this buffer and land where they are asked to.
const READ_BUFFER_BYTES: usize = 4096;
/// While the frames arriving are small (payloads up to
/// [`SMALL_FRAME_BYTES`]), a buffered read asks for this many bytes
/// instead: a stream of small frames (a broadcast root running ahead)
/// then comes in several frames per `recv`, and the reader takes the
/// receiving socket's lock — which the loopback delivery of the sender's
/// next frame needs too — less often. Measured, 2 processes over
/// loopback, 5 alternating runs of 5000 iterations: broadcast 4 KiB
/// 3.4–4.9 → 3.2–4.0 µs per call (medians 4.7 → 3.4 out of place, 4.4 →
/// 3.4 in place), other collectives within the noise. After a larger
/// frame reads go back to [`READ_BUFFER_BYTES`]: a large read ahead copies
/// part of a large payload a second time (with 32 KiB always, ring
/// all-reduce 1–4 MiB ran 3–5 % slower).
const SMALL_FRAME_READ_BYTES: usize = 32 * 1024;
/// See [`SMALL_FRAME_READ_BYTES`].
pub(crate) const SMALL_FRAME_BYTES: usize = 8 * 1024;

/// One TCP link as a non-blocking byte stream.
pub(crate) struct TcpLink {
    stream: TcpStream,
    /// Bytes read ahead of what was asked: `read_buf[read_start..read_end]`
    /// come before anything still in the socket.
    read_buf: Box<[u8]>,
    read_start: usize,
    read_end: usize,
    /// How many bytes a buffered read asks for now (see
    /// [`SMALL_FRAME_READ_BYTES`]); at most `read_buf.len()`.
    read_ahead: usize,
}

impl TcpLink {
    pub fn new(stream: TcpStream) -> TcpLink {
        TcpLink {
            stream,
            read_buf: vec![0; SMALL_FRAME_READ_BYTES].into_boxed_slice(),
            read_start: 0,
            read_end: 0,
            read_ahead: READ_BUFFER_BYTES,
        }
    }

    /// Tells the link the payload size of the frame whose header was just
    /// read: the next buffered reads ask for more while frames are small.
    pub fn saw_frame(&mut self, payload_bytes: usize) {
        self.read_ahead = if payload_bytes <= SMALL_FRAME_BYTES {
            SMALL_FRAME_READ_BYTES
        } else {
            READ_BUFFER_BYTES
        };
    }

    /// Whether bytes read from the socket are waiting in the link's own
    /// buffer (polling the socket would not see them).
    pub fn has_buffered(&self) -> bool {
        self.read_start < self.read_end
    }

    pub fn fd(&self) -> libc::c_int {
        self.stream.as_raw_fd()
    }

    /// Writes what the socket takes now; `Err` means the peer is gone.
    pub fn write_some(&mut self, data: &[u8]) -> io::Result<usize> {
        loop {
            match self.stream.write(data) {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Writes a prefix of `a ++ b` in one system call.
    pub fn write_two(&mut self, a: &[u8], b: &[u8]) -> io::Result<usize> {
        self.write_slices(&[io::IoSlice::new(a), io::IoSlice::new(b)])
    }

    /// Writes a prefix of the concatenated `slices` with one `sendmsg`;
    /// returns how many bytes went out (0 when the socket is full).
    ///
    /// `sendmsg` with `MSG_NOSIGNAL`, not `writev` (what
    /// `TcpStream::write_vectored` calls): a write to a peer that reset the
    /// connection raises `SIGPIPE`, which kills a process that has not
    /// ignored it (a C host; `oxccl-perf`, which restores the default for
    /// `| head`) before the error can name the rank that died.
    /// `TcpStream::write` already sends with the flag.
    pub fn write_slices(&mut self, slices: &[io::IoSlice<'_>]) -> io::Result<usize> {
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // `IoSlice` is ABI-compatible with `iovec` on Unix; the kernel only
        // reads through the pointer. At most IOV_MAX (1024 on Linux)
        // slices go in one call: the rest is a later prefix.
        msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = slices.len().min(1024) as _;
        loop {
            // SAFETY: `msg` points at `msg_iovlen` live slices for the call.
            let sent = unsafe { libc::sendmsg(self.fd(), &msg, libc::MSG_NOSIGNAL) };
            let result = if sent >= 0 {
                Ok(sent as usize)
            } else {
                Err(io::Error::last_os_error())
            };
            match result {
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads what has arrived; `Err` (including end of stream) means the
    /// peer is gone.
    pub fn read_some(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if !self.has_buffered() {
            if buf.len() >= self.read_ahead {
                return self.recv(buf);
            }
            let mut read_buf = std::mem::take(&mut self.read_buf);
            let ahead = self.read_ahead;
            let got = self.recv(&mut read_buf[..ahead]);
            self.read_buf = read_buf;
            (self.read_start, self.read_end) = (0, got?);
        }
        let n = (self.read_end - self.read_start).min(buf.len());
        buf[..n].copy_from_slice(&self.read_buf[self.read_start..self.read_start + n]);
        self.read_start += n;
        Ok(n)
    }

    /// One `recv` into `buf` (not empty): 0 when nothing has arrived.
    fn recv(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.stream.read(buf) {
                Ok(0) if !buf.is_empty() => {
                    return Err(io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "connection closed by the peer",
                    ))
                }
                Ok(n) => return Ok(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(0),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv4Addr};

    #[test]
    fn handshake_accepts_the_job_and_refuses_strangers() {
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let token = [7u8; 16];
        let deadline = Instant::now() + Duration::from_secs(10);
        // Strangers first: garbage, a wrong token, and one that sends nothing.
        let mut garbage = TcpStream::connect(addr).unwrap();
        garbage
            .write_all(b"GET / HTTP/1.1\r\n\r\n12345678901234")
            .unwrap();
        let mut wrong = TcpStream::connect(addr).unwrap();
        wrong.write_all(&hello(&[9u8; 16], 2, 0)).unwrap();
        let _silent = TcpStream::connect(addr).unwrap();
        let peers = std::thread::spawn(move || {
            let a = connect(addr, &token, 1, 0, deadline).unwrap();
            let b = connect(addr, &token, 2, 0, deadline).unwrap();
            (a, b)
        });
        let accepted = accept(&listener, &token, 0, &[1, 2], deadline).unwrap();
        assert_eq!(accepted.len(), 2);
        let (mut a, _b) = peers.join().unwrap();
        // The refused ones were closed without an acknowledgement.
        let mut buf = [0u8; 4];
        wrong
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert!(matches!(wrong.read(&mut buf), Ok(0) | Err(_)));
        // The accepted link carries bytes.
        let mut link = TcpLink::new(accepted.into_iter().find(|(r, _)| *r == 1).unwrap().1);
        a.set_nonblocking(false).unwrap();
        a.write_all(b"hello").unwrap();
        let mut got = Vec::new();
        while got.len() < 5 {
            let mut b = [0u8; 8];
            let n = link.read_some(&mut b).unwrap();
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, b"hello");
        drop(a);
        let end = Instant::now() + Duration::from_secs(5);
        loop {
            match link.read_some(&mut [0u8; 8]) {
                Err(_) => break,
                Ok(_) => assert!(Instant::now() < end, "EOF not seen"),
            }
        }
    }

    /// Strangers that connect and say nothing are refused after
    /// HELLO_PATIENCE, while the set-up still runs, and no more than
    /// MAX_PENDING are held at once, so they cannot use up the descriptors
    /// the ranks need; a rank that connects after them is still accepted.
    #[test]
    fn silent_strangers_past_the_cap_are_refused_while_accepting() {
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let token = [3u8; 16];
        let deadline = Instant::now() + Duration::from_secs(20);
        let accepting = std::thread::spawn(move || {
            accept(&listener, &token, 0, &[1], deadline).map(|m| m.len())
        });
        let mut silent: Vec<TcpStream> = (0..MAX_PENDING + 8)
            .map(|_| TcpStream::connect(addr).unwrap())
            .collect();
        // The first one is closed by the acceptor, before any rank came.
        let first = &mut silent[0];
        first
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        assert!(matches!(first.read(&mut [0u8; 4]), Ok(0) | Err(_)));
        assert!(!accepting.is_finished());
        let rank = connect(addr, &token, 1, 0, deadline).unwrap();
        assert_eq!(accepting.join().unwrap(), Ok(1));
        drop(rank);
    }

    /// Small reads go through the link's buffer, large ones bypass it;
    /// either way the stream comes out whole and in order, and the end of
    /// the stream is reported only after every buffered byte.
    #[test]
    fn buffered_reads_keep_the_stream_whole_and_in_order() {
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
        let mut writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        reader.set_nonblocking(true).unwrap();
        let mut link = TcpLink::new(reader);
        let sent: Vec<u8> = (0..400_000u32).map(|i| (i * 31 + 7) as u8).collect();
        // From another thread: more than the sockets' buffers may hold.
        let writing = {
            let sent = sent.clone();
            std::thread::spawn(move || {
                writer.write_all(&sent).unwrap();
                drop(writer);
            })
        };
        // Header-sized, small, large and odd-sized reads, in a cycle, with
        // the read-ahead switching between its two sizes (frames seen
        // small, then large) at sizes on either side of both.
        let sizes = [64, 8, 3, 20_000, 1, 4095, 4096, 9000, 40_000, 32_768];
        let seen = [100, SMALL_FRAME_BYTES + 1, SMALL_FRAME_BYTES, 0, 70_000];
        let mut got = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        for (size, frame) in sizes.iter().cycle().zip(seen.iter().cycle()) {
            link.saw_frame(*frame);
            let mut buf = vec![0u8; *size];
            match link.read_some(&mut buf) {
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::UnexpectedEof, "{e}");
                    break;
                }
            }
            assert!(Instant::now() < deadline, "stream not finished");
        }
        writing.join().unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "bytes reordered or changed");
    }

    /// Run by [`a_write_to_a_reset_peer_is_an_error_not_sigpipe`] in a
    /// process of its own (it changes a process-wide signal disposition).
    #[test]
    #[ignore]
    fn child_writes_to_a_reset_peer_with_sigpipe_at_its_default() {
        if std::env::var_os("OXCCL_TEST_SIGPIPE_CHILD").is_none() {
            return;
        }
        // SAFETY: setting a disposition; this process runs this test only.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut peer, _) = listener.accept().unwrap();
        let mut link = TcpLink::new(writer);
        // Closing with unread bytes makes the peer reset the connection.
        assert_eq!(link.write_two(b"unread", b"").unwrap(), 6);
        std::thread::sleep(Duration::from_millis(50));
        peer.write_all(b"x").unwrap();
        drop(peer);
        std::thread::sleep(Duration::from_millis(50));
        let mut errors = 0;
        for _ in 0..100 {
            if link.write_two(&[1u8; 4096], &[2u8; 4096]).is_err() {
                errors += 1;
                if errors == 3 {
                    break;
                }
            }
        }
        assert_eq!(errors, 3, "writes to a reset peer kept succeeding");
        println!("writes failed with errors, no signal");
    }

    #[test]
    fn a_write_to_a_reset_peer_is_an_error_not_sigpipe() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "transport::tcp::tests::child_writes_to_a_reset_peer_with_sigpipe_at_its_default",
            ])
            .args(["--ignored", "--nocapture", "--test-threads=1"])
            .env("OXCCL_TEST_SIGPIPE_CHILD", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{:?}\n{text}", out.status);
        assert!(
            text.contains("writes failed with errors, no signal"),
            "{text}"
        );
    }

    #[test]
    fn accept_names_the_ranks_that_never_came() {
        let listener = TcpListener::bind((IpAddr::V4(Ipv4Addr::LOCALHOST), 0)).unwrap();
        let deadline = Instant::now() + Duration::from_millis(100);
        assert_eq!(
            accept(&listener, &[0; 16], 0, &[3, 5], deadline).unwrap_err(),
            vec![3, 5]
        );
    }
}
