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

    /// The communicator was aborted with [`Communicator::abort`](crate::Communicator::abort)
    /// (or by a peer's abort); every call in progress and every later call
    /// returns this.
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
