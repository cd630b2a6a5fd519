//! Rendezvous: how the ranks of a job find each other before any collective.
//!
//! A [`Store`] is a small key-value service every rank can reach (torch's
//! `TCPStore` role). Rank 0 hosts a [`TcpStore`] at `MASTER_ADDR:MASTER_PORT`;
//! a [`FileStore`] serves jobs on a shared file system; a [`MemoryStore`]
//! serves ranks that are threads of one process (tests). Every wait on a store
//! has a deadline, and a timed-out wait says which keys never appeared, so
//! rendezvous can say which ranks never joined.
//!
//! [`LaunchEnv`] reads the variables launchers already set (torchrun, Open
//! MPI, Slurm, and our own `oxccl-run`).

mod env;
mod file;
mod memory;
mod prefix;
mod tcp;

use std::time::Duration;

use crate::error::Result;

pub use env::{LaunchEnv, LaunchSource};
pub use file::FileStore;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub(crate) use tcp::resolve_by;
pub use tcp::TcpStore;

/// The most ranks a job may have: rendezvous waits for one key per rank,
/// and the store refuses a wait on more keys. A larger world size (a typo,
/// a corrupt variable) is a clear error, not an allocation that aborts.
pub(crate) const MAX_WORLD_SIZE: usize = 64 * 1024;

/// A key-value store shared by the ranks of one job, used only while
/// communicators are set up (never on a collective's hot path).
///
/// Keys are UTF-8 strings; values are bytes. Every method that waits takes a
/// timeout and never blocks longer than it (plus one network round trip).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any earlier value, and wakes waiters.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) when the store cannot be reached.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, or `None` if it is not set. Does not wait.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) when the store cannot be reached.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>>;

    /// Adds `delta` to the integer counter at `key` (absent counts as 0) and
    /// returns the new value, atomically with respect to every other caller.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) when the store cannot be
    /// reached or `key` holds something other than a counter.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;

    /// Waits until every key in `keys` is set, for at most `timeout`.
    ///
    /// Returns `Ok(vec![])` when all are set, or `Ok(missing)` with the keys
    /// still unset when the timeout passes (in the order given): the caller
    /// turns that list into an error that names what never arrived.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) when the store cannot be reached.
    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>>;

    /// Where the store is, for messages: `10.0.0.1:29500`, `file:/shared/job`,
    /// `memory`.
    fn describe(&self) -> String;

    /// Waits for `key` (at most `timeout`) and returns its value.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`](crate::Error::Bootstrap) naming the key when it
    /// is not set in time, or when the store cannot be reached.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let missing = self.wait(&[key.to_string()], timeout)?;
        if missing.is_empty() {
            if let Some(value) = self.try_get(key)? {
                return Ok(value);
            }
        }
        Err(crate::Error::Bootstrap {
            context: format!("store {}", self.describe()),
            detail: format!("key {key:?} was not set within {timeout:?}"),
        })
    }
}
