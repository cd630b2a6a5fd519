//! Errors returned by every oxccl call.
//!
//! Every variant says *which* operation failed, and where a peer is involved,
//! *which* peer: a user looking at one line of a log from one rank must be able
//! to tell what that rank was doing and whom it was waiting for.

use std::time::Duration;

use crate::types::{OpKind, Rank};

/// The result type of every fallible oxccl call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in oxccl.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The arguments of a call were rejected before any data moved.
    ///
    /// Returned by [`CollectiveDesc::validate`](crate::CollectiveDesc::validate)
    /// on the calling rank only; the other ranks will see this rank as late
    /// (a [`Error::Timeout`] naming it) if they entered the same collective.
    #[error("rank {rank}: invalid argument `{arg}` to {op}: {reason}")]
    InvalidArgument {
        /// The operation that was called.
        op: OpKind,
        /// The calling rank.
        rank: Rank,
        /// The name of the offending argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// A wait for a peer passed its deadline.
    #[error(
        "rank {rank}: {op} #{seq} timed out after {waited:?} waiting for rank {peer} \
         (set OXCCL_TIMEOUT or CommConfig::timeout to wait longer)"
    )]
    Timeout {
        /// The operation in progress.
        op: OpKind,
        /// Its sequence number on this communicator (0 for the first call).
        seq: u64,
        /// The rank that timed out.
        rank: Rank,
        /// The peer that did not answer.
        peer: Rank,
        /// How long the wait lasted.
        waited: Duration,
    },

    /// A peer left the job (its communicator was dropped, its thread died or
    /// its process exited) while this rank still expected data from it.
    #[error("rank {rank}: {op} #{seq}: peer rank {peer} is gone")]
    PeerLost {
        /// The operation in progress.
        op: OpKind,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The rank that noticed.
        rank: Rank,
        /// The rank that is gone.
        peer: Rank,
    },

    /// A peer gave up on the call because rank `late` did not answer
    /// within the timeout (the peer timed out waiting for it, or failed
    /// because a rank before it did: that rank's own error is a
    /// [`Error::Timeout`] naming `late`), so this rank cannot finish the
    /// call either. `late` is where to look: a rank stuck or slow outside
    /// oxccl, or one that called something else.
    #[error(
        "rank {rank}: {op} #{seq}: peer rank {peer} gave up on this call: rank {late} did not \
         answer within the timeout"
    )]
    PeerTimedOut {
        /// The operation in progress.
        op: OpKind,
        /// Its sequence number on this communicator.
        seq: u64,
        /// The rank that noticed.
        rank: Rank,
        /// The failed rank this one met (it timed out, or failed because a
        /// rank it waited on did).
        peer: Rank,
        /// The rank that did not answer.
        late: Rank,
    },

    /// The ranks disagree about which collective they are running: a frame
    /// arrived for the same sequence number but a different operation or a
    /// different size. Usually a program that calls collectives in different
    /// orders or with different counts on different ranks.
    #[error("rank {rank}: {op} #{seq}: mismatch with rank {peer}: {detail}")]
    Mismatch {
        /// The operation this rank is running.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The rank that noticed.
        rank: Rank,
        /// The peer whose frame did not match.
        peer: Rank,
        /// What differed.
        detail: String,
    },

    /// The operating system refused a transfer with a peer that set-up had
    /// allowed: reading or writing its memory directly (CMA,
    /// `process_vm_readv`) is no longer permitted, e.g. after a process
    /// made itself undumpable or changed its user, or
    /// `kernel.yama.ptrace_scope` was raised. `OXCCL_ALGO=ring` avoids it.
    #[error("rank {rank}: {op} #{seq}: the system refused a transfer with rank {peer}: {detail}")]
    Refused {
        /// The operation this rank is running.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The rank that met it.
        rank: Rank,
        /// The peer of the transfer.
        peer: Rank,
        /// What was refused, and why.
        detail: String,
    },

    /// The communicator was aborted with [`Communicator::abort`](crate::Communicator::abort)
    /// (by any thread holding an [`AbortHandle`](crate::AbortHandle) of its
    /// group in this process). A call in progress returns this, as does
    /// the next call of a communicator that was between calls (one that
    /// moves no data included); after that, calls return [`Error::Failed`]
    /// naming it. Other processes see the rank leave once it drops its
    /// communicators.
    #[error("rank {rank}: {op} #{seq}: communicator aborted")]
    Aborted {
        /// The operation in progress.
        op: OpKind,
        /// Its sequence number.
        seq: u64,
        /// The rank that noticed.
        rank: Rank,
    },

    /// A configuration value (an environment variable or a builder field) is
    /// malformed or contradictory.
    #[error("invalid configuration {name}={value:?}: {reason}")]
    Config {
        /// The variable or field.
        name: String,
        /// Its value as given.
        value: String,
        /// Why it was rejected.
        reason: String,
    },

    /// Rendezvous did not complete: some ranks never reached a step of the
    /// set-up (`stage`: joining, sharing memory, connecting) before the
    /// deadline. Every rank that waited reports the same list, so any one
    /// log line says which ranks to look at.
    #[error(
        "rank {rank}: rendezvous at {store} timed out after {waited:?}: {} ({})",
        describe_missing(missing, *stage),
        stage.hint()
    )]
    RendezvousTimeout {
        /// The rank that waited (and reports).
        rank: Rank,
        /// Where the store is ([`Store::describe`](crate::bootstrap::Store::describe)),
        /// e.g. `10.0.0.1:29500` or `file:/shared/job42`.
        store: String,
        /// How long this rank waited.
        waited: Duration,
        /// The step of the set-up the missing ranks never reached.
        stage: RendezvousStage,
        /// The ranks that never reached it, ascending.
        missing: Vec<Rank>,
    },

    /// Setting up a communicator failed before any collective ran: the store
    /// could not be hosted or reached, a connection or a shared-memory segment
    /// could not be made, a peer presented a bad handshake.
    #[error("{context}: {detail}")]
    Bootstrap {
        /// What was being done, naming the rank and the address or peer.
        context: String,
        /// What went wrong and, where known, how to fix it.
        detail: String,
    },

    /// A shared library oxccl loads at run time (NCCL, the CUDA driver) could
    /// not be loaded under any of the names tried.
    #[error("{library} could not be loaded; tried: {}; {hint}", tried.join("; "))]
    LibraryNotFound {
        /// Which library (`NCCL`, `CUDA driver`).
        library: &'static str,
        /// Each name or path tried, with the loader's reason.
        tried: Vec<String>,
        /// How to install it or point oxccl at it.
        hint: String,
    },

    /// A run-time library loaded but is too old for what was asked of it.
    #[error("{library}: {detail}")]
    LibraryUnsupported {
        /// Which library.
        library: &'static str,
        /// Its version, what needs a newer one, and how to get one.
        detail: String,
    },

    /// An NCCL call failed; carries NCCL's own code and text.
    #[error("rank {rank}: {call} failed: {name} ({code}): {detail}")]
    Nccl {
        /// The calling rank.
        rank: Rank,
        /// The NCCL function, e.g. `ncclAllReduce`.
        call: &'static str,
        /// Its `ncclResult_t`.
        code: i32,
        /// The code's name in `nccl.h`, e.g. `ncclUnhandledCudaError`.
        name: &'static str,
        /// `ncclGetLastError`, else `ncclGetErrorString`.
        detail: String,
    },

    /// A CUDA driver call failed, or no usable device exists.
    #[error("rank {rank}: {context}: {detail}")]
    Cuda {
        /// The calling rank.
        rank: Rank,
        /// What was being done (the driver call or the step of set-up).
        context: String,
        /// The driver's error text, and where known how to fix it.
        detail: String,
    },

    /// A GPU-side wait (communicator initialisation, split, a stream holding
    /// a collective) passed its deadline; the communicator was aborted so
    /// nothing stays blocked behind it.
    #[error(
        "rank {rank}: {what} did not finish within {waited:?} (communicator aborted; \
         set OXCCL_TIMEOUT to wait longer)"
    )]
    DeviceTimeout {
        /// The calling rank.
        rank: Rank,
        /// What was awaited, e.g. `ncclCommInitRankConfig (world 2, GPU 0)`.
        what: String,
        /// How long the wait lasted.
        waited: Duration,
    },

    /// The communicator failed earlier (timeout, lost peer, mismatch, abort)
    /// and can no longer be used; make a new one.
    #[error("rank {rank}: {op}: communicator unusable after an earlier error: {first_error}")]
    Failed {
        /// The operation that was called.
        op: OpKind,
        /// The calling rank.
        rank: Rank,
        /// The first error, as text.
        first_error: String,
    },
}

/// `rank 3 never joined` / `ranks 2 and 5 never joined` / `ranks 1, 2 and 4 never joined`.
/// The step of a communicator's set-up that a [`Error::RendezvousTimeout`]
/// waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RendezvousStage {
    /// Registering with the store (the first step: a rank missing here did
    /// not start, or joined another store or world size).
    Join,
    /// Publishing its shared-memory inbox (after joining).
    ShmInbox,
    /// Mapping the other ranks' shared-memory inboxes.
    ShmMapped,
    /// Opening its TCP link to the reporting rank.
    Connect,
    /// Rank 0 publishing the device backend it chose.
    BackendChoice,
    /// Rank 0 publishing NCCL's unique id.
    NcclUniqueId,
}

impl RendezvousStage {
    /// What a missing rank never did, after "rank N".
    fn never(self) -> &'static str {
        match self {
            RendezvousStage::Join => "never joined",
            RendezvousStage::ShmInbox => "joined but never published its shared-memory inbox",
            RendezvousStage::ShmMapped => {
                "joined but never mapped the others' shared-memory inboxes"
            }
            RendezvousStage::Connect => "joined but never connected to this rank",
            RendezvousStage::BackendChoice => "never published the device backend it chose",
            RendezvousStage::NcclUniqueId => "never published NCCL's unique id",
        }
    }

    /// Where to look.
    fn hint(self) -> &'static str {
        match self {
            RendezvousStage::Join => {
                "are they running, and do they use the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?"
            }
            RendezvousStage::ShmInbox | RendezvousStage::ShmMapped => {
                "they stopped or failed while setting up shared memory: see their output; \
                 is /dev/shm full?"
            }
            RendezvousStage::Connect => {
                "their own error says why: usually the network interface or a firewall"
            }
            RendezvousStage::BackendChoice | RendezvousStage::NcclUniqueId => {
                "is rank 0 running, and did its own set-up fail? see its output"
            }
        }
    }
}

/// A store's error (it names the store and the key, not the rank that met
/// it) told as this rank's, in the set-up step `what`: every rank reports,
/// so say which. Errors that already name a rank pass unchanged.
pub(crate) fn as_ranks_store_error(e: Error, rank: Rank, what: &str) -> Error {
    match e {
        Error::Bootstrap { context, detail } if !context.starts_with("rank ") => Error::Bootstrap {
            context: format!("rank {rank}: {what} through {context}"),
            detail,
        },
        other => other,
    }
}

pub(crate) fn describe_missing(missing: &[Rank], stage: RendezvousStage) -> String {
    let never = stage.never();
    match missing {
        [] => "every rank arrived".into(),
        [one] => format!("rank {one} {never}"),
        [init @ .., last] => {
            let init: Vec<String> = init.iter().map(|r| r.to_string()).collect();
            // "ranks 2 and 5 never joined": the verb for several.
            let never = never.replace("its ", "their ");
            format!("ranks {} and {last} {never}", init.join(", "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ranks_read_as_english() {
        let join = RendezvousStage::Join;
        assert_eq!(describe_missing(&[3], join), "rank 3 never joined");
        assert_eq!(
            describe_missing(&[2, 5], join),
            "ranks 2 and 5 never joined"
        );
        assert_eq!(
            describe_missing(&[1, 2, 4], join),
            "ranks 1, 2 and 4 never joined"
        );
        assert_eq!(
            describe_missing(&[2, 5], RendezvousStage::ShmInbox),
            "ranks 2 and 5 joined but never published their shared-memory inbox"
        );
        let e = Error::RendezvousTimeout {
            rank: 1,
            store: "10.0.0.1:29500".into(),
            waited: Duration::from_secs(30),
            stage: join,
            missing: vec![2, 5],
        };
        assert!(e.to_string().starts_with(
            "rank 1: rendezvous at 10.0.0.1:29500 timed out after 30s: ranks 2 and 5 never joined"
        ));
    }
}
