//! Test harness: one thread per rank, like Gloo's `base_test.h`.
#![allow(dead_code)]

use std::sync::mpsc;
use std::time::Duration;

use std::sync::Arc;

use oxccl::bootstrap::MemoryStore;
use oxccl::{CommBuilder, Communicator, Result, TransportKind};

/// Wall-clock limit for one `run_ranks` call: a hang fails the test instead
/// of stalling CI.
pub const GLOBAL_DEADLINE: Duration = Duration::from_secs(120);

/// Runs `body` on `n` ranks of a local group built by `builder`, one thread
/// each; joins every thread, and returns each rank's result or the first error.
pub fn run_ranks_with<R, F>(
    n: usize,
    builder: CommBuilder,
    body: F,
) -> std::result::Result<Vec<R>, String>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    let comms = builder.local_group(n).map_err(|e| e.to_string())?;
    let comms = Arc::new(std::sync::Mutex::new(
        comms.into_iter().map(Some).collect::<Vec<_>>(),
    ));
    run_each(
        n,
        move |rank| Ok(comms.lock().unwrap()[rank].take().expect("one per rank")),
        body,
    )
}

/// As [`run_ranks_with`], but the ranks join through a shared in-memory
/// store and talk over the multi-process transport (`kind`: shared memory
/// or TCP), as separate processes would.
pub fn run_ranks_net<R, F>(
    n: usize,
    builder: CommBuilder,
    kind: TransportKind,
    body: F,
) -> std::result::Result<Vec<R>, String>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    let store = Arc::new(MemoryStore::new());
    let builder = builder.transport(kind);
    run_each(n, move |rank| builder.init(rank, n, store.clone()), body)
}

fn run_each<R, M, F>(n: usize, make: M, body: F) -> std::result::Result<Vec<R>, String>
where
    R: Send + 'static,
    M: Fn(usize) -> Result<Communicator> + Send + Sync + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    let body = Arc::new(body);
    let make = Arc::new(make);
    let (tx, rx) = mpsc::channel();
    let mut handles = Vec::new();
    for rank in 0..n {
        let tx = tx.clone();
        let body = body.clone();
        let make = make.clone();
        handles.push(std::thread::spawn(move || {
            let mut comm = match make(rank) {
                Ok(comm) => comm,
                Err(e) => {
                    let _ = tx.send((rank, Err(format!("rank {rank} init: {e}"))));
                    return;
                }
            };
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut comm)));
            let outcome = match result {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e.to_string()),
                Err(panic) => Err(format!(
                    "rank {rank} panicked: {}",
                    panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default()
                )),
            };
            // Drop the communicator before reporting so peers see it leave.
            drop(comm);
            let _ = tx.send((rank, outcome));
        }));
    }
    drop(tx);
    let mut results: Vec<Option<R>> = (0..n).map(|_| None).collect();
    let mut first_error = None;
    let deadline = std::time::Instant::now() + GLOBAL_DEADLINE;
    for _ in 0..n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(v))) => results[rank] = Some(v),
            Ok((_, Err(e))) => {
                first_error.get_or_insert(e);
            }
            Err(_) => return Err(format!("ranks did not finish within {GLOBAL_DEADLINE:?}")),
        }
    }
    for h in handles {
        let _ = h.join();
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(results
            .into_iter()
            .map(|r| r.expect("every rank reported"))
            .collect()),
    }
}

/// [`run_ranks_with`] with a 20 s per-wait timeout; panics on the first error.
pub fn run_ranks<R, F>(n: usize, body: F) -> Vec<R>
where
    R: Send + 'static,
    F: Fn(&mut Communicator) -> Result<R> + Send + Sync + 'static,
{
    run_ranks_with(
        n,
        Communicator::builder().timeout(Duration::from_secs(20)),
        body,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A port for one test's store: free now, handed to no other test of this
/// binary, and below the kernel's ephemeral range (`ip_local_port_range`),
/// which `bind(0)`, outgoing connections and `oxccl-run`'s own pick draw
/// from (where that range starts above 21000; otherwise below 32768, and
/// only the bind check keeps kernel-chosen ports away). Asking the kernel for port 0 instead let two tests running at once
/// get the same port: the rank-0-never-starts drill's rank 1 then joined
/// another test's job and failed mapping that job's arena.
pub fn free_port() -> u16 {
    static HANDED_OUT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    const LOWEST: usize = 20_000;
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<usize>().ok())
        .filter(|&low| low > LOWEST + 1000)
        .unwrap_or(32_768);
    let span = ephemeral_low - LOWEST;
    // Binaries that run at once (other checkouts) start apart.
    let start = std::process::id() as usize % span;
    for _ in 0..span {
        let n = HANDED_OUT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let port = (LOWEST + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {LOWEST}..{ephemeral_low}");
}

/// Runs `body` with this thread pinned to the first CPU it may use, then
/// restores its mask (also when `body` panics, before the panic goes on).
/// Threads it starts and processes it spawns inherit the one-CPU mask, so
/// ranks there outnumber their CPUs on any host.
pub fn on_one_cpu<R>(body: impl FnOnce() -> R) -> R {
    // SAFETY: cpu_set_t is plain data; the calls read or set this thread's
    // affinity only.
    let (before, size) = unsafe {
        let mut before: libc::cpu_set_t = std::mem::zeroed();
        let size = std::mem::size_of::<libc::cpu_set_t>();
        assert_eq!(libc::sched_getaffinity(0, size, &mut before), 0);
        let first = (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &before))
            .expect("some CPU");
        let mut one: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(first, &mut one);
        assert_eq!(libc::sched_setaffinity(0, size, &one), 0);
        (before, size)
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    // SAFETY: as above.
    unsafe { libc::sched_setaffinity(0, size, &before) };
    result.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}
