//! A plain TCP stream between two processes over loopback, without oxccl:
//! how fast this machine's kernel moves bulk data through a socket right
//! now.
//!
//! On the 2-vCPU VM of `docs/performance.md`, loopback TCP runs in two
//! regimes that change every few seconds: in the slow one the kernel's copy
//! into the socket takes several times longer, and every bulk transfer
//! (oxccl's, Open MPI's broadcast, this program's) slows about twofold at
//! the same moments, while `memcpy` between a process's own buffers does
//! not. The slow regime is the VM's far vCPU placement (stop 41: median
//! 4.9 ms per 8 MiB far, 2.2 ms near), where every line of a socket buffer
//! crosses between dies. Run beside a TCP benchmark, this tells which
//! regime its figures came from.
//!
//! ```text
//! cargo run --release --example tcp_stream_probe -- [BYTES] [MESSAGES] [ROUNDS]
//! ```
//!
//! The parent accepts on 127.0.0.1 and starts itself again as the sender.
//! Each round the parent asks for `MESSAGES` messages of `BYTES` (default
//! 8 MiB, 20, 5; `BYTES` at most 1 GiB), reads them into one warm buffer
//! with blocking `read`s, and times the round from its request to the last
//! byte. Both sockets have
//! `TCP_NODELAY` and the kernel's default (autotuned) buffers: what a
//! straightforward program gets. One line:
//!
//! `TCP_STREAM,bytes,messages,rounds,median_us,min_us,max_us,median_GBps`
//!
//! with the time per message over the rounds.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

/// No connect, read or write of this program waits longer (a round of the
/// default size takes milliseconds).
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the sender may take to start and connect, and to exit once
/// its socket is closed.
const SENDER_DEADLINE: Duration = Duration::from_secs(10);

/// The largest message this program takes (it holds one on each side).
const MAX_BYTES: usize = 1 << 30;

fn usage() -> ExitCode {
    eprintln!("usage: tcp_stream_probe [BYTES] [MESSAGES] [ROUNDS] (see the source's header)");
    ExitCode::from(2)
}

/// A count from 1 to `max` from the command line.
fn count(arg: Option<&String>, default: usize, max: usize) -> Option<usize> {
    match arg {
        None => Some(default),
        Some(text) => text.parse().ok().filter(|&n| n > 0 && n <= max),
    }
}

/// The sender process, killed and reaped however the receiving side ends.
struct Sender(Child);

impl Drop for Sender {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sender: connects to `port` and, for every request byte, writes
/// `messages` messages of `bytes` from one warm buffer.
fn send(port: u16, bytes: usize, messages: usize) -> std::io::Result<()> {
    let mut stream =
        TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), IO_TIMEOUT)?;
    stream.set_nodelay(true)?;
    // A receiver that went away without closing must not keep this
    // process waiting for its next request forever.
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let data = vec![1u8; bytes];
    let mut request = [0u8; 1];
    while stream.read(&mut request)? == 1 {
        for _ in 0..messages {
            stream.write_all(&data)?;
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--sender") {
        let parsed = (
            args.get(1).and_then(|p| p.parse().ok()),
            count(args.get(2), 0, MAX_BYTES).filter(|&n| n > 0),
            count(args.get(3), 0, usize::MAX).filter(|&n| n > 0),
        );
        let (Some(port), Some(bytes), Some(messages)) = parsed else {
            return usage();
        };
        return match send(port, bytes, messages) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("tcp_stream_probe: sender: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.iter().any(|a| a == "-h" || a == "--help") || args.len() > 3 {
        return usage();
    }
    let (Some(bytes), Some(messages), Some(rounds)) = (
        count(args.first(), 8 << 20, MAX_BYTES),
        count(args.get(1), 20, usize::MAX),
        count(args.get(2), 5, usize::MAX),
    ) else {
        return usage();
    };
    match receive(bytes, messages, rounds) {
        Ok(mut per_message) => {
            per_message.sort_by(f64::total_cmp);
            let median = per_message[per_message.len() / 2];
            println!(
                "TCP_STREAM,{bytes},{messages},{rounds},{median:.1},{:.1},{:.1},{:.2}",
                per_message[0],
                per_message[per_message.len() - 1],
                bytes as f64 / median / 1e3
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tcp_stream_probe: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The receiving side: starts the sender, and returns each round's time
/// per message in microseconds.
fn receive(bytes: usize, messages: usize, rounds: usize) -> std::io::Result<Vec<f64>> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let port = listener.local_addr()?.port();
    let mut sender = Sender(
        Command::new(std::env::current_exe()?)
            .args(["--sender", &port.to_string(), &bytes.to_string()])
            .arg(messages.to_string())
            .spawn()?,
    );
    // Accept with a deadline: a sender that failed to start must not leave
    // this process waiting forever.
    listener.set_nonblocking(true)?;
    let started = Instant::now();
    let mut stream = loop {
        match listener.accept() {
            Ok((stream, _)) => break stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if started.elapsed() >= SENDER_DEADLINE || sender.0.try_wait()?.is_some() {
                    return Err(std::io::Error::other("the sender never connected"));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(e),
        }
    };
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut buffer = vec![0u8; bytes];
    let mut per_message = Vec::with_capacity(rounds);
    // One untimed round first: connection set-up, buffer growth, page faults.
    for round in 0..=rounds {
        let start = Instant::now();
        stream.write_all(&[1])?;
        for _ in 0..messages {
            stream.read_exact(&mut buffer)?;
        }
        if round > 0 {
            per_message.push(start.elapsed().as_secs_f64() * 1e6 / messages as f64);
        }
    }
    // The sender ends when it reads the end of the stream.
    drop(stream);
    let closed = Instant::now();
    while sender.0.try_wait()?.is_none() {
        if closed.elapsed() >= SENDER_DEADLINE {
            return Err(std::io::Error::other("the sender did not exit"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(per_message)
}
