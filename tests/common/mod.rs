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
