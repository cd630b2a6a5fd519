//! The TCP store: rank 0 hosts it, every other rank connects to it
//! (torch's `TCPStore` role).
//!
//! # Wire protocol
//!
//! After connecting, the client sends [`CLIENT_MAGIC`] and the protocol
//! version (`u32`), and the server answers [`SERVER_MAGIC`] and its version.
//! Then every request and every reply is one frame: a `u32` little-endian
//! body length followed by the body. Integers are little-endian; a string or
//! a byte string is a `u32` length followed by its bytes.
//!
//! | request body | reply body (after a status byte, 0 = ok) |
//! |---|---|
//! | `SET key value` | — |
//! | `GET key` | `u8` present, then `value` if present |
//! | `ADD key i64` | `i64` new value |
//! | `WAIT u64-timeout-ms u32-count key...` | `u32 count` then the keys still missing |
//!
//! A reply whose status byte is 1 carries an error message instead. A
//! malformed or oversized request closes that connection only; the server
//! logs one line to stderr and keeps serving the other clients.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::memory::MemoryStore;
use super::Store;
use crate::error::{Error, Result};

/// Sent by a client right after connecting.
const CLIENT_MAGIC: &[u8; 8] = b"OXCCLSTC";
/// Sent by the server in answer to [`CLIENT_MAGIC`].
const SERVER_MAGIC: &[u8; 8] = b"OXCCLSTS";
/// Bumped whenever the frame format changes.
const PROTOCOL_VERSION: u32 = 1;

/// Longest key, in bytes.
const MAX_KEY: usize = 4 * 1024;
/// Longest value, in bytes.
const MAX_VALUE: usize = 64 * 1024 * 1024;
/// Most keys in one wait: rendezvous waits for every rank's.
const MAX_WAIT_KEYS: usize = super::MAX_WORLD_SIZE;
/// Longest frame body: a maximal set plus room for the header fields.
const MAX_FRAME: usize = MAX_VALUE + MAX_KEY + 64;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_WAIT: u8 = 4;

const STATUS_OK: u8 = 0;
const STATUS_ERR: u8 = 1;

/// How often the server's threads look at the stop flag.
const POLL: Duration = Duration::from_millis(100);
/// How often the accept loop looks for new clients.
const ACCEPT_POLL: Duration = Duration::from_millis(10);
/// How long the server waits for a client to take a reply.
const SERVER_WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a new connection has to send its handshake, and a request its
/// body once its length has come: a stray client (a port scanner, a
/// connection left open) or one that trickles a large frame holds a server
/// thread and the frame's memory only this long. (Shorter in unit tests.)
const HANDSHAKE_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_millis(300)
} else {
    Duration::from_secs(10)
};
const REQUEST_BODY_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_millis(300)
} else {
    Duration::from_secs(60)
};
/// Shortest per-operation timeout of a client.
const MIN_IO_TIMEOUT: Duration = Duration::from_secs(1);

/// A [`Store`] reached over TCP. Rank 0 [`host`](TcpStore::host)s it and
/// uses the map directly; the other ranks [`connect`](TcpStore::connect).
///
/// A connected store may be shared by several threads: each call uses a
/// connection of its own (kept open for later calls), so a long wait never
/// delays another thread. A call never blocks longer than its timeout plus
/// the per-operation timeout given to `connect` (at least one second).
///
/// Dropping the hosting store stops the server: its listener closes and every
/// client connection is closed within about 100 ms.
pub struct TcpStore {
    inner: Inner,
}

enum Inner {
    Host(Host),
    Client(Client),
}

struct Host {
    map: MemoryStore,
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    acceptor: Option<JoinHandle<()>>,
}

struct Client {
    addr: String,
    /// Connections not in use by a call. A call takes one (or opens a new
    /// one), so a long wait on one thread never delays another thread's
    /// calls; a connection that failed mid-frame is dropped, not returned.
    idle: Mutex<Vec<TcpStream>>,
    io_timeout: Duration,
}

impl TcpStore {
    /// Hosts the store on `bind` (e.g. `0.0.0.0:29500`) and serves it from
    /// background threads until this value is dropped.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`] when the address cannot be bound, saying so
    /// plainly when the port is already in use.
    pub fn host(bind: SocketAddr) -> Result<TcpStore> {
        let context = format!("hosting the rendezvous store on {bind}");
        let listener = TcpListener::bind(bind).map_err(|e| Error::Bootstrap {
            context: context.clone(),
            detail: match e.kind() {
                io::ErrorKind::AddrInUse if hosted_here(bind.port()) => format!(
                    "port {} is already in use ({e}) by a store this process hosts for a \
                     communicator that is still alive: make one communicator per job and \
                     split it, drop the first before making another, or give the second \
                     its own MASTER_PORT",
                    bind.port()
                ),
                io::ErrorKind::AddrInUse => format!(
                    "port {} is already in use ({e}): another job, or an earlier run still \
                     exiting? Choose another MASTER_PORT (oxccl-run --master-port)",
                    bind.port()
                ),
                io::ErrorKind::AddrNotAvailable => format!(
                    "{} is not an address of this host ({e}); check MASTER_ADDR",
                    bind.ip()
                ),
                _ => format!("cannot listen: {e}"),
            },
        })?;
        let os_err = |e: io::Error| Error::Bootstrap {
            context: context.clone(),
            detail: format!("cannot set up the listener: {e}"),
        };
        let addr = listener.local_addr().map_err(os_err)?;
        listener.set_nonblocking(true).map_err(os_err)?;
        let map = MemoryStore::new();
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let map = map.clone();
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("oxccl-store".into())
                .spawn(move || accept_loop(listener, map, stop))
                .map_err(|e| Error::Bootstrap {
                    context: context.clone(),
                    detail: format!("cannot start the server thread: {e}"),
                })?
        };
        hosted_ports().push(addr.port());
        Ok(TcpStore {
            inner: Inner::Host(Host {
                map,
                addr,
                stop,
                acceptor: Some(acceptor),
            }),
        })
    }

    /// Connects to the store at `addr` (`host:port`; the host may be a name),
    /// retrying until `timeout` passes, since rank 0 may not be listening yet.
    /// `timeout` (at least one second) also bounds every later call's
    /// exchange with the server, on top of a wait's own timeout.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`] when nothing answers at `addr` within `timeout`,
    /// or when what answers is not an oxccl store.
    pub fn connect(addr: &str, timeout: Duration) -> Result<TcpStore> {
        let start = Instant::now();
        let deadline = deadline_after(start, timeout);
        let context = format!("connecting to the rendezvous store at {addr}");
        let mut last_error;
        let stream = loop {
            match try_connect(addr, deadline) {
                Ok(stream) => break stream,
                Err(e) => last_error = e,
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Bootstrap {
                    context,
                    detail: format!(
                        "could not reach the store within {timeout:?} (last error: {last_error}); \
                         rank 0 hosts it: check that rank 0 is running and that \
                         MASTER_ADDR/MASTER_PORT are right"
                    ),
                });
            }
            std::thread::sleep((deadline - now).min(Duration::from_millis(100)));
        };
        handshake(&stream, addr, &context, deadline)?;
        Ok(TcpStore {
            inner: Inner::Client(Client {
                addr: addr.to_string(),
                idle: Mutex::new(vec![stream]),
                io_timeout: timeout.max(MIN_IO_TIMEOUT),
            }),
        })
    }

    /// The address the hosting store listens on (useful after binding port
    /// 0); `None` for a connected store.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &self.inner {
            Inner::Host(host) => Some(host.addr),
            Inner::Client(_) => None,
        }
    }

    fn error(&self, detail: String) -> Error {
        Error::Bootstrap {
            context: format!("store {}", self.describe()),
            detail,
        }
    }
}

impl Drop for TcpStore {
    fn drop(&mut self) {
        if let Inner::Host(host) = &mut self.inner {
            host.stop.store(true, Ordering::SeqCst);
            if let Some(acceptor) = host.acceptor.take() {
                // The accept loop notices the flag within ACCEPT_POLL; joining
                // it closes the listener before drop returns.
                let _ = acceptor.join();
            }
            let mut ports = hosted_ports();
            if let Some(i) = ports.iter().position(|&p| p == host.addr.port()) {
                ports.swap_remove(i);
            }
        }
    }
}

/// The ports this process hosts stores on, so that a second store on one
/// of them (a second communicator from the same variables while the first
/// lives) is told as such rather than as another job's.
fn hosted_ports() -> std::sync::MutexGuard<'static, Vec<u16>> {
    static PORTS: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    PORTS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn hosted_here(port: u16) -> bool {
    hosted_ports().contains(&port)
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key).map_err(|d| self.error(d))?;
        if value.len() > MAX_VALUE {
            return Err(self.error(format!(
                "value of key {key:?} is {} bytes; the most a store value may hold is {MAX_VALUE}",
                value.len()
            )));
        }
        match &self.inner {
            Inner::Host(host) => host.map.set(key, value),
            Inner::Client(client) => {
                let mut req = vec![OP_SET];
                put_bytes(&mut req, key.as_bytes());
                put_bytes(&mut req, value);
                client.call(&req, Duration::ZERO).map(|_| ())
            }
        }
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key).map_err(|d| self.error(d))?;
        match &self.inner {
            Inner::Host(host) => host.map.try_get(key),
            Inner::Client(client) => {
                let mut req = vec![OP_GET];
                put_bytes(&mut req, key.as_bytes());
                let reply = client.call(&req, Duration::ZERO)?;
                let mut r = Reader::new(&reply);
                let parsed = (|| match r.u8()? {
                    0 => Some(None),
                    _ => Some(Some(r.bytes(MAX_VALUE)?.to_vec())),
                })();
                parsed.ok_or_else(|| client.bad_reply())
            }
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key).map_err(|d| self.error(d))?;
        match &self.inner {
            Inner::Host(host) => host
                .map
                .add(key, delta)
                .map_err(|_| self.error(not_a_counter(key))),
            Inner::Client(client) => {
                let mut req = vec![OP_ADD];
                put_bytes(&mut req, key.as_bytes());
                req.extend_from_slice(&delta.to_le_bytes());
                let reply = client.call(&req, Duration::ZERO)?;
                Reader::new(&reply).i64().ok_or_else(|| client.bad_reply())
            }
        }
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        if keys.len() > MAX_WAIT_KEYS {
            return Err(self.error(format!(
                "a wait for {} keys; at most {MAX_WAIT_KEYS} may be waited for at once",
                keys.len()
            )));
        }
        for key in keys {
            check_key(key).map_err(|d| self.error(d))?;
        }
        match &self.inner {
            Inner::Host(host) => Ok(wait_sliced(&host.map, keys, timeout, &host.stop)),
            Inner::Client(client) => {
                let mut req = vec![OP_WAIT];
                let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
                req.extend_from_slice(&ms.to_le_bytes());
                req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                for key in keys {
                    put_bytes(&mut req, key.as_bytes());
                }
                if req.len() > MAX_FRAME {
                    return Err(self.error("the keys of this wait are too long in total".into()));
                }
                let reply = client.call(&req, timeout)?;
                parse_key_list(&reply).ok_or_else(|| client.bad_reply())
            }
        }
    }

    fn describe(&self) -> String {
        match &self.inner {
            Inner::Host(host) => host.addr.to_string(),
            Inner::Client(client) => client.addr.clone(),
        }
    }
}

impl Client {
    fn idle(&self) -> MutexGuard<'_, Vec<TcpStream>> {
        // Pushes and pops only: a panic cannot leave the list torn.
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn error(&self, detail: String) -> Error {
        Error::Bootstrap {
            context: format!("store {}", self.addr),
            detail,
        }
    }

    fn bad_reply(&self) -> Error {
        self.error("the store sent a malformed reply".into())
    }

    /// An idle connection, or a new one (one attempt, within the
    /// per-operation timeout).
    fn take_connection(&self) -> Result<TcpStream> {
        if let Some(stream) = self.idle().pop() {
            return Ok(stream);
        }
        let deadline = deadline_after(Instant::now(), self.io_timeout);
        let stream = try_connect(&self.addr, deadline).map_err(|e| {
            self.error(format!(
                "cannot reach the store any more ({e}); rank 0 hosts the store: did it exit?"
            ))
        })?;
        let _ = stream.set_nodelay(true);
        handshake(
            &stream,
            &self.addr,
            &format!("store {}", self.addr),
            deadline,
        )?;
        Ok(stream)
    }

    /// Sends one request and returns the body of the reply after its status
    /// byte. `extra` is how long the server may legitimately take (a wait's
    /// timeout) on top of the per-operation timeout.
    fn call(&self, request: &[u8], extra: Duration) -> Result<Vec<u8>> {
        let stream = self.take_connection()?;
        let start = Instant::now();
        let write_deadline = deadline_after(start, self.io_timeout);
        let read_deadline = deadline_after(start, self.io_timeout.saturating_add(extra));
        let mut frame = Vec::with_capacity(4 + request.len());
        frame.extend_from_slice(&(request.len() as u32).to_le_bytes());
        frame.extend_from_slice(request);
        let exchange = write_all_deadline(&stream, &frame, write_deadline)
            .and_then(|()| read_frame_deadline(&stream, read_deadline));
        let body = match exchange {
            Ok(body) => body,
            Err(e) => {
                // The stream may be in the middle of a frame: never reuse it.
                let _ = stream.shutdown(Shutdown::Both);
                return Err(self.error(format!(
                    "lost the connection to the store ({e}); rank 0 hosts the store: did it \
                     exit or stall?"
                )));
            }
        };
        let result = match body.split_first() {
            Some((&STATUS_OK, rest)) => Ok(rest.to_vec()),
            Some((&STATUS_ERR, rest)) => {
                Err(self.error(String::from_utf8_lossy(rest).into_owned()))
            }
            _ => {
                let _ = stream.shutdown(Shutdown::Both);
                return Err(self.bad_reply());
            }
        };
        self.idle().push(stream);
        result
    }
}

/// Sends our magic and version and checks the server's answer.
fn handshake(stream: &TcpStream, addr: &str, context: &str, deadline: Instant) -> Result<()> {
    let not_a_store = |why: String| Error::Bootstrap {
        context: context.to_string(),
        detail: format!(
            "the server at {addr} is not an oxccl store ({why}); is the port taken by \
             another program?"
        ),
    };
    // Give the handshake at least a moment even when the connect used up
    // (almost) all of the timeout.
    let deadline = deadline.max(deadline_after(Instant::now(), Duration::from_millis(500)));
    let mut hello = Vec::with_capacity(12);
    hello.extend_from_slice(CLIENT_MAGIC);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    write_all_deadline(stream, &hello, deadline)
        .map_err(|e| not_a_store(format!("sending the handshake failed: {e}")))?;
    let mut reply = [0u8; 12];
    read_exact_deadline(stream, &mut reply, deadline).map_err(|e| {
        if matches!(
            e.kind(),
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
        ) {
            // Accepted (by the kernel) but never served: another program,
            // or a store that cannot take the connection in.
            Error::Bootstrap {
                context: context.to_string(),
                detail: format!(
                    "the server at {addr} took the connection but did not answer the \
                     handshake in time ({e}): is the port taken by another program, or is \
                     rank 0's store out of file descriptors (`ulimit -n`; it says so on \
                     its stderr) or stopped?"
                ),
            }
        } else {
            not_a_store(format!("no valid handshake reply: {e}"))
        }
    })?;
    if &reply[..8] != SERVER_MAGIC {
        return Err(not_a_store(format!(
            "it answered {:?}",
            String::from_utf8_lossy(&reply)
        )));
    }
    let version = u32::from_le_bytes([reply[8], reply[9], reply[10], reply[11]]);
    if version != PROTOCOL_VERSION {
        return Err(Error::Bootstrap {
            context: context.to_string(),
            detail: format!(
                "the store speaks protocol version {version}, this rank {PROTOCOL_VERSION}: \
                 every rank must run the same oxccl version"
            ),
        });
    }
    Ok(())
}

fn not_a_counter(key: &str) -> String {
    format!("key {key:?} holds a value that is not a counter")
}

fn check_key(key: &str) -> std::result::Result<(), String> {
    if key.len() > MAX_KEY {
        Err(format!(
            "a key of {} bytes; keys may be at most {MAX_KEY} bytes",
            key.len()
        ))
    } else {
        Ok(())
    }
}

/// `start + timeout`, or a day later when that overflows.
fn deadline_after(start: Instant, timeout: Duration) -> Instant {
    start
        .checked_add(timeout)
        .or_else(|| start.checked_add(Duration::from_secs(86_400)))
        .unwrap_or(start)
}

/// A wait on the shared map that gives up early when the server stops.
fn wait_sliced(
    map: &MemoryStore,
    keys: &[String],
    timeout: Duration,
    stop: &AtomicBool,
) -> Vec<String> {
    let deadline = deadline_after(Instant::now(), timeout);
    let mut missing = keys.to_vec();
    loop {
        let now = Instant::now();
        let slice = deadline.saturating_duration_since(now).min(POLL);
        // MemoryStore::wait cannot fail. Keys are never removed, so each
        // slice waits only for those the last one still missed.
        missing = map.wait(&missing, slice).unwrap_or(missing);
        if missing.is_empty() || Instant::now() >= deadline || stop.load(Ordering::SeqCst) {
            return missing;
        }
    }
}

/// The addresses of `addr` (`host:port`), by `deadline`: a name goes to
/// the system's resolver on a thread of its own, since `getaddrinfo` has no
/// timeout and a slow or broken resolver blocks it for tens of seconds per
/// try (the thread is left to finish on its own past the deadline). An
/// address that is already numeric is parsed at once.
pub(crate) fn resolve_by(
    addr: &str,
    deadline: Instant,
) -> std::result::Result<Vec<SocketAddr>, String> {
    if let Ok(numeric) = addr.parse::<SocketAddr>() {
        return Ok(vec![numeric]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = addr.to_string();
    std::thread::Builder::new()
        .name("oxccl-resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(Iterator::collect::<Vec<_>>));
        })
        .map_err(|e| format!("cannot resolve {addr}: no thread for the resolver: {e}"))?;
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(resolved) => resolved.map_err(|e| format!("cannot resolve {addr}: {e}")),
        Err(_) => Err(format!(
            "resolving {addr} did not finish in time (a slow or unreachable name server?)"
        )),
    }
}

fn try_connect(addr: &str, deadline: Instant) -> std::result::Result<TcpStream, String> {
    let targets = resolve_by(addr, deadline)?;
    let mut last = format!("{addr} resolved to no address");
    for target in targets {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = left.clamp(Duration::from_millis(10), Duration::from_secs(2));
        match TcpStream::connect_timeout(&target, attempt) {
            Ok(stream) => return Ok(stream),
            Err(e) => last = format!("{target}: {e}"),
        }
    }
    Err(last)
}

fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Bounds-checked decoding of a frame body; every method returns `None` past
/// the end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if n > self.buf.len() {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Option<u64> {
        let b: [u8; 8] = self.take(8)?.try_into().ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn i64(&mut self) -> Option<i64> {
        let b: [u8; 8] = self.take(8)?.try_into().ok()?;
        Some(i64::from_le_bytes(b))
    }

    fn bytes(&mut self, max: usize) -> Option<&'a [u8]> {
        let len = self.u32()? as usize;
        if len > max {
            return None;
        }
        self.take(len)
    }

    fn key(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes(MAX_KEY)?).ok()
    }

    fn done(&self) -> bool {
        self.buf.is_empty()
    }
}

fn parse_key_list(body: &[u8]) -> Option<Vec<String>> {
    let mut r = Reader::new(body);
    let count = r.u32()? as usize;
    if count > MAX_WAIT_KEYS {
        return None;
    }
    let mut keys = Vec::with_capacity(count);
    for _ in 0..count {
        keys.push(r.key()?.to_string());
    }
    r.done().then_some(keys)
}

// ---------------------------------------------------------------- I/O helpers

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

fn read_exact_deadline(
    mut stream: &TcpStream,
    buf: &mut [u8],
    deadline: Instant,
) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the connection was closed",
                ))
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_deadline(mut stream: &TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut sent = 0;
    while sent < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(&buf[sent..]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_frame_deadline(stream: &TcpStream, deadline: Instant) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    read_exact_deadline(stream, &mut len, deadline)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a reply of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len];
    read_exact_deadline(stream, &mut body, deadline)?;
    Ok(body)
}

// --------------------------------------------------------------------- server

fn accept_loop(listener: TcpListener, map: MemoryStore, stop: Arc<AtomicBool>) {
    // Out of descriptors, every pass fails: said once a minute at most.
    let mut told_out_of_fds: Option<Instant> = None;
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let map = map.clone();
                let stop = Arc::clone(&stop);
                let spawned = std::thread::Builder::new()
                    .name("oxccl-store-client".into())
                    .spawn(move || serve_client(stream, peer, &map, &stop));
                if let Err(e) = spawned {
                    eprintln!("oxccl: store: cannot serve the client at {peer}: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(ACCEPT_POLL),
            // The ranks waiting in the backlog would otherwise time out
            // blaming the network or another program.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) => {
                if told_out_of_fds.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    told_out_of_fds = Some(Instant::now());
                    eprintln!(
                        "oxccl: store: cannot take in more ranks' connections: {e} (this \
                         process may open {} files; raise `ulimit -n`)",
                        open_file_limit().map_or("a limited number of".into(), |n| n.to_string())
                    );
                }
                std::thread::sleep(ACCEPT_POLL);
            }
            // ECONNABORTED and the like: back off and keep serving.
            Err(_) => std::thread::sleep(ACCEPT_POLL),
        }
    }
}

/// This process's soft limit on open files, if it has one.
fn open_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0;
    (ok && limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}

/// Why a client's connection ended.
enum End {
    /// The client left, or the server is stopping: close quietly.
    Quiet,
    /// The client sent something that is not a request: log and close.
    Malformed(String),
}

impl From<io::Error> for End {
    fn from(_: io::Error) -> End {
        End::Quiet
    }
}

fn serve_client(stream: TcpStream, peer: SocketAddr, map: &MemoryStore, stop: &AtomicBool) {
    if let End::Malformed(why) = serve_client_inner(&stream, map, stop) {
        eprintln!("oxccl: store: dropped a malformed request from {peer}: {why}");
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn serve_client_inner(stream: &TcpStream, map: &MemoryStore, stop: &AtomicBool) -> End {
    let setup = || -> io::Result<()> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(POLL))?;
        stream.set_write_timeout(Some(SERVER_WRITE_TIMEOUT))
    };
    if setup().is_err() {
        return End::Quiet;
    }
    let mut hello = [0u8; 12];
    let by = Instant::now() + HANDSHAKE_TIMEOUT;
    if let Err(end) = read_full(stream, &mut hello, stop, Some(by)) {
        return end;
    }
    if &hello[..8] != CLIENT_MAGIC {
        return End::Malformed(format!(
            "not an oxccl store handshake ({:?})",
            String::from_utf8_lossy(&hello)
        ));
    }
    let mut reply = Vec::with_capacity(12);
    reply.extend_from_slice(SERVER_MAGIC);
    reply.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    if let Err(e) = (&*stream).write_all(&reply) {
        return e.into();
    }
    let version = u32::from_le_bytes([hello[8], hello[9], hello[10], hello[11]]);
    if version != PROTOCOL_VERSION {
        // The client reports the mismatch from our reply; nothing to serve.
        return End::Quiet;
    }
    loop {
        let mut len = [0u8; 4];
        // Between requests a client may be idle for the whole job.
        if let Err(end) = read_full(stream, &mut len, stop, None) {
            return end;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_FRAME {
            return End::Malformed(format!("a frame of {len} bytes (at most {MAX_FRAME})"));
        }
        let mut body = vec![0u8; len];
        let by = Instant::now() + REQUEST_BODY_TIMEOUT;
        if let Err(end) = read_full(stream, &mut body, stop, Some(by)) {
            return end;
        }
        let Some(answer) = handle(&body, map, stop) else {
            return End::Malformed(describe_bad_request(&body));
        };
        let Some(answer) = answer else {
            return End::Quiet; // stopping in the middle of a wait
        };
        let mut frame = Vec::with_capacity(4 + answer.len());
        frame.extend_from_slice(&(answer.len() as u32).to_le_bytes());
        frame.extend_from_slice(&answer);
        if let Err(e) = (&*stream).write_all(&frame) {
            return e.into();
        }
    }
}

fn describe_bad_request(body: &[u8]) -> String {
    match body.first() {
        None => "an empty frame".into(),
        Some(&op) if !(OP_SET..=OP_WAIT).contains(&op) => format!("unknown operation {op}"),
        Some(&op) => format!(
            "a {} request of {} bytes that does not parse (oversized or not UTF-8 key, bad \
             lengths?)",
            ["", "SET", "GET", "ADD", "WAIT"][op as usize],
            body.len()
        ),
    }
}

/// Reads exactly `buf.len()` bytes, checking the stop flag between reads.
/// Reads all of `buf`, by `deadline` if one is given (past it the client
/// is dropped as malformed: it started something and did not finish it).
fn read_full(
    mut stream: &TcpStream,
    buf: &mut [u8],
    stop: &AtomicBool,
    deadline: Option<Instant>,
) -> std::result::Result<(), End> {
    let mut filled = 0;
    while filled < buf.len() {
        if stop.load(Ordering::SeqCst) {
            return Err(End::Quiet);
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(End::Malformed(format!(
                "{filled} of {} bytes came within the time allowed",
                buf.len()
            )));
        }
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(End::Quiet),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
            Err(_) => return Err(End::Quiet),
        }
    }
    Ok(())
}

/// Runs one request. `None`: malformed; `Some(None)`: the server is stopping;
/// `Some(Some(reply))`: the reply body.
fn handle(body: &[u8], map: &MemoryStore, stop: &AtomicBool) -> Option<Option<Vec<u8>>> {
    let mut r = Reader::new(body);
    let op = r.u8()?;
    let mut reply = vec![STATUS_OK];
    match op {
        OP_SET => {
            let key = r.key()?;
            let value = r.bytes(MAX_VALUE)?;
            if !r.done() {
                return None;
            }
            // MemoryStore::set cannot fail.
            let _ = map.set(key, value);
        }
        OP_GET => {
            let key = r.key()?;
            if !r.done() {
                return None;
            }
            match map.try_get(key).ok().flatten() {
                None => reply.push(0),
                Some(value) => {
                    reply.push(1);
                    put_bytes(&mut reply, &value);
                }
            }
        }
        OP_ADD => {
            let key = r.key()?;
            let delta = r.i64()?;
            if !r.done() {
                return None;
            }
            match map.add(key, delta) {
                Ok(next) => reply.extend_from_slice(&next.to_le_bytes()),
                Err(_) => {
                    reply = vec![STATUS_ERR];
                    reply.extend_from_slice(not_a_counter(key).as_bytes());
                }
            }
        }
        OP_WAIT => {
            let timeout = Duration::from_millis(r.u64()?);
            let count = r.u32()? as usize;
            if count > MAX_WAIT_KEYS {
                return None;
            }
            let mut keys = Vec::with_capacity(count);
            for _ in 0..count {
                keys.push(r.key()?.to_string());
            }
            if !r.done() {
                return None;
            }
            let missing = wait_sliced(map, &keys, timeout, stop);
            if stop.load(Ordering::SeqCst) {
                return Some(None);
            }
            reply.extend_from_slice(&(missing.len() as u32).to_le_bytes());
            for key in &missing {
                put_bytes(&mut reply, key.as_bytes());
            }
        }
        _ => return None,
    }
    Some(Some(reply))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> (TcpStore, String) {
        let store = TcpStore::host("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = store.local_addr().unwrap().to_string();
        (store, addr)
    }

    #[test]
    fn set_get_add_wait_across_threads() {
        let (host, addr) = host();
        assert_eq!(host.describe(), addr);
        let client = Arc::new(TcpStore::connect(&addr, Duration::from_secs(5)).unwrap());
        assert_eq!(client.describe(), addr);
        assert!(client.local_addr().is_none());

        host.set("a", b"1").unwrap();
        assert_eq!(client.try_get("a").unwrap(), Some(b"1".to_vec()));
        client.set("b", b"").unwrap();
        assert_eq!(host.try_get("b").unwrap(), Some(Vec::new()));
        assert_eq!(client.try_get("none").unwrap(), None);
        assert_eq!(client.add("n", 2).unwrap(), 2);
        assert_eq!(host.add("n", 3).unwrap(), 5);
        assert_eq!(client.try_get("n").unwrap(), Some(b"5".to_vec()));
        client.set("text", b"x").unwrap();
        let e = client.add("text", 1).unwrap_err().to_string();
        assert!(e.contains("not a counter"), "{e}");
        let e = host.add("text", 1).unwrap_err().to_string();
        assert!(e.contains("not a counter"), "{e}");
        // The connection is still usable after an error reply.
        assert_eq!(client.add("n", 1).unwrap(), 6);

        // Concurrent adds from several clients and threads give unique values.
        let mut threads = Vec::new();
        for i in 0..4 {
            let addr = addr.clone();
            let shared = Arc::clone(&client);
            threads.push(std::thread::spawn(move || {
                let own = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
                let store: &dyn Store = if i % 2 == 0 { &own } else { &*shared };
                (0..25)
                    .map(|_| store.add("ctr", 1).unwrap())
                    .collect::<Vec<_>>()
            }));
        }
        let mut all: Vec<i64> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (1..=100).collect::<Vec<_>>());

        // A wait satisfied by another thread's set.
        let setter = Arc::clone(&client);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            setter.set("late", b"v").unwrap();
        });
        let waiter = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        assert_eq!(waiter.get("late", Duration::from_secs(5)).unwrap(), b"v");
        t.join().unwrap();
        assert_eq!(host.get("late", Duration::from_secs(1)).unwrap(), b"v");

        // Large values round-trip.
        let big: Vec<u8> = (0..3_000_000u32).map(|i| i as u8).collect();
        client.set("big", &big).unwrap();
        assert_eq!(waiter.try_get("big").unwrap().unwrap(), big);
    }

    #[test]
    fn wait_reports_exactly_the_missing_keys_after_its_timeout() {
        let (host, addr) = host();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        host.set("k1", b"x").unwrap();
        let keys: Vec<String> = ["k0", "k1", "k2"].iter().map(|s| s.to_string()).collect();
        for store in [&host as &dyn Store, &client] {
            let start = Instant::now();
            let missing = store.wait(&keys, Duration::from_millis(300)).unwrap();
            let took = start.elapsed();
            assert_eq!(missing, vec!["k0".to_string(), "k2".to_string()]);
            assert!(took >= Duration::from_millis(290), "{took:?}");
            assert!(took < Duration::from_millis(1500), "{took:?}");
        }
        assert!(client
            .wait(&[], Duration::from_secs(10))
            .unwrap()
            .is_empty());
        let e = client.get("never", Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("\"never\" was not set"), "{e}");
        // A huge timeout does not overflow anywhere.
        host.set("k0", b"").unwrap();
        host.set("k2", b"").unwrap();
        assert!(client.wait(&keys, Duration::MAX).unwrap().is_empty());
        assert!(host.wait(&keys, Duration::MAX).unwrap().is_empty());
    }

    #[test]
    fn oversized_keys_are_refused_locally() {
        let (host, addr) = host();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        let long = "k".repeat(MAX_KEY + 1);
        assert!(client.set(&long, b"").is_err());
        assert!(host.set(&long, b"").is_err());
        assert!(client.try_get(&long).is_err());
        // And the connection is unaffected.
        client.set("ok", b"1").unwrap();
        assert_eq!(client.try_get("ok").unwrap(), Some(b"1".to_vec()));
    }

    #[test]
    fn connect_to_a_closed_port_fails_within_its_timeout() {
        // Bind then drop, so the port is (almost certainly) free.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let start = Instant::now();
        let e = TcpStore::connect(&format!("127.0.0.1:{port}"), Duration::from_millis(400))
            .err()
            .unwrap()
            .to_string();
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(350), "{took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        assert!(e.contains("could not reach the store"), "{e}");
        assert!(e.contains("rank 0"), "{e}");
        assert!(e.contains("MASTER_ADDR/MASTER_PORT"), "{e}");
        assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
    }

    #[test]
    fn port_in_use_gives_a_clear_error() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let e = TcpStore::host(addr).err().unwrap().to_string();
        assert!(
            e.contains(&format!("hosting the rendezvous store on {addr}")),
            "{e}"
        );
        assert!(
            e.contains(&format!("port {} is already in use", addr.port())),
            "{e}"
        );
        assert!(e.contains("MASTER_PORT"), "{e}");
    }

    /// A connection that says nothing, and one that sends a frame's length
    /// and then stops, are closed by the server after their time (shorter
    /// in unit tests), instead of holding a server thread and the frame's
    /// buffer for the whole job.
    #[test]
    fn numeric_addresses_resolve_at_once_and_names_by_the_deadline() {
        let passed = Instant::now();
        let at = resolve_by("127.0.0.1:29500", passed).unwrap();
        assert_eq!(at, vec!["127.0.0.1:29500".parse().unwrap()]);
        let at = resolve_by("[::1]:29500", passed).unwrap();
        assert_eq!(at, vec!["[::1]:29500".parse().unwrap()]);
        let soon = Instant::now() + Duration::from_secs(10);
        assert!(resolve_by("localhost:29500", soon).is_ok_and(|a| !a.is_empty()));
        let e = resolve_by("no port", soon).unwrap_err();
        assert!(e.contains("no port"), "{e}");
    }

    #[test]
    fn silent_and_stalled_connections_are_closed() {
        let (_host, addr) = host();
        let mut silent = TcpStream::connect(&addr).unwrap();
        let mut stalled = TcpStream::connect(&addr).unwrap();
        stalled.write_all(CLIENT_MAGIC).unwrap();
        stalled.write_all(&PROTOCOL_VERSION.to_le_bytes()).unwrap();
        stalled.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
        stalled.write_all(&[OP_SET, 0, 0]).unwrap();
        let start = Instant::now();
        for raw in [&mut silent, &mut stalled] {
            raw.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let mut sink = Vec::new();
            // The handshake reply, then the end of the stream (or a reset).
            let _ = raw.read_to_end(&mut sink);
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn garbage_from_one_connection_does_not_disturb_others() {
        let (host, addr) = host();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        client.set("before", b"1").unwrap();

        // Not a handshake at all.
        let mut raw = TcpStream::connect(&addr).unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\ngarbage garbage")
            .unwrap();
        // A handshake followed by an oversized frame.
        let mut raw2 = TcpStream::connect(&addr).unwrap();
        raw2.write_all(CLIENT_MAGIC).unwrap();
        raw2.write_all(&PROTOCOL_VERSION.to_le_bytes()).unwrap();
        raw2.write_all(&u32::MAX.to_le_bytes()).unwrap();
        // A handshake followed by a well-sized frame with a lying key length.
        let mut raw3 = TcpStream::connect(&addr).unwrap();
        raw3.write_all(CLIENT_MAGIC).unwrap();
        raw3.write_all(&PROTOCOL_VERSION.to_le_bytes()).unwrap();
        let body = [OP_GET, 0xff, 0xff, 0xff, 0x7f, b'k'];
        raw3.write_all(&(body.len() as u32).to_le_bytes()).unwrap();
        raw3.write_all(&body).unwrap();
        // An unknown op, then a wait with too many keys.
        let mut raw4 = TcpStream::connect(&addr).unwrap();
        raw4.write_all(CLIENT_MAGIC).unwrap();
        raw4.write_all(&PROTOCOL_VERSION.to_le_bytes()).unwrap();
        raw4.write_all(&1u32.to_le_bytes()).unwrap();
        raw4.write_all(&[99]).unwrap();

        // Each bad connection is closed by the server.
        for raw in [&mut raw, &mut raw2, &mut raw3, &mut raw4] {
            raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut sink = Vec::new();
            let _ = raw.read_to_end(&mut sink);
        }

        client.set("after", b"2").unwrap();
        assert_eq!(client.try_get("before").unwrap(), Some(b"1".to_vec()));
        assert_eq!(host.try_get("after").unwrap(), Some(b"2".to_vec()));
        let again = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        assert_eq!(again.add("n", 1).unwrap(), 1);
    }

    #[test]
    fn a_foreign_server_is_detected() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let _ = s.write_all(b"HTTP/1.1 400\r\n");
            std::thread::sleep(Duration::from_millis(200));
        });
        let e = TcpStore::connect(&addr, Duration::from_secs(2))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not an oxccl store"), "{e}");
        t.join().unwrap();

        // A server that accepts and says nothing.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = std::thread::spawn(move || {
            let (_s, _) = listener.accept().unwrap();
            std::thread::sleep(Duration::from_millis(1500));
        });
        let start = Instant::now();
        let e = TcpStore::connect(&addr, Duration::from_millis(600))
            .err()
            .unwrap()
            .to_string();
        assert!(start.elapsed() < Duration::from_millis(1400));
        // Silence may also be a store that cannot take the connection in.
        assert!(e.contains("did not answer the handshake in time"), "{e}");
        assert!(
            e.contains("another program") && e.contains("ulimit -n"),
            "{e}"
        );
        t.join().unwrap();
    }

    #[test]
    fn dropping_the_host_stops_the_server() {
        let (host, addr) = host();
        let client = TcpStore::connect(&addr, Duration::from_secs(5)).unwrap();
        client.set("k", b"v").unwrap();
        drop(host);
        let e = TcpStore::connect(&addr, Duration::from_millis(300)).err();
        assert!(e.is_some(), "connect after the host was dropped must fail");
        // The existing client's connection is closed by the server.
        std::thread::sleep(Duration::from_millis(300));
        let e = client.try_get("k").unwrap_err().to_string();
        assert!(e.contains("lost the connection"), "{e}");
        // The next call tries a new connection, which is refused.
        let e = client.try_get("k").unwrap_err().to_string();
        assert!(e.contains("cannot reach the store any more"), "{e}");
    }

    #[test]
    fn a_long_wait_does_not_delay_other_threads() {
        let (host, addr) = host();
        let client = Arc::new(TcpStore::connect(&addr, Duration::from_secs(5)).unwrap());
        let waiter = Arc::clone(&client);
        let t = std::thread::spawn(move || waiter.get("go", Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        client.set("go", b"1").unwrap();
        assert_eq!(client.add("n", 1).unwrap(), 1);
        assert!(start.elapsed() < Duration::from_secs(2));
        assert_eq!(t.join().unwrap(), b"1");
        drop(host);
    }

    #[test]
    fn a_client_waiting_when_the_host_drops_gets_an_error_promptly() {
        let (host, addr) = host();
        let client = TcpStore::connect(&addr, Duration::from_secs(1)).unwrap();
        let t = std::thread::spawn(move || {
            let start = Instant::now();
            let r = client.wait(&["never".into()], Duration::from_secs(30));
            (r.is_err(), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(host);
        let (failed, took) = t.join().unwrap();
        assert!(failed);
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
