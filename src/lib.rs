//! # oxccl — typed collective communication
//!
//! One typed [`Communicator`] with all-reduce, reduce-scatter, all-gather,
//! broadcast, reduce, send/recv, all-to-all, barrier and split, over
//! `f32 f64 f16 bf16 i8 u8 i32 u32 i64 u64` and [`ReduceOp`] `Sum Prod Min
//! Max Avg`.
//!
//! | layer | module |
//! |---|---|
//! | typed API | [`Communicator`], [`Element`], [`ReduceOp`] |
//! | argument check | [`CollectiveDesc::validate`] — every call, before any data moves |
//! | schedules (pure data) | [`schedule`] — ring, chain, direct and dissemination plans as lists of [`schedule::Step`] |
//! | host executor | runs plans over a transport with the CPU reductions in [`host::reduce`] |
//! | shared arena | one mapping every local rank reads and writes: lanes, mailboxes and staged rounds for an all-local group, zero copy between threads and for [`Communicator::alloc_shared`] buffers |
//! | transports | in-process (threads); shared memory and TCP between processes ([`TransportKind`]) |
//! | bootstrap | [`bootstrap`] — stores for rendezvous, launcher variables ([`Communicator::from_env`]) |
//! | launcher | [`launch`] — `oxccl-run` starts, supervises and stops one node's ranks |
//!
//! | backend | memory | status |
//! |---|---|---|
//! | host, in-process | `&[T]` | built |
//! | host, shared memory / TCP | `&[T]` | built |
//! | `nccl` | GPU ([`DeviceCommunicator`], feature `nccl`) | built |
//! | `cuda-ring` | GPU ([`DeviceCommunicator`], feature `cuda`) | ranks as threads of one process, or processes of one host (CUDA IPC) |
//!
//! ```
//! use oxccl::{Communicator, ReduceOp};
//! let comms = Communicator::local_group(4).unwrap();
//! let handles: Vec<_> = comms.into_iter().map(|mut comm| std::thread::spawn(move || {
//!     let mut grads = vec![comm.rank() as f32; 1000];
//!     comm.all_reduce_in_place(&mut grads, ReduceOp::Sum).unwrap();
//!     assert!(grads.iter().all(|&g| g == 6.0));
//! })).collect();
//! for h in handles { h.join().unwrap(); }
//! ```
#![deny(missing_docs)]

pub mod bootstrap;
pub mod check;
mod comm;
#[cfg(feature = "cuda")]
mod cuda;
mod desc;
#[cfg(feature = "cuda")]
pub mod device;
mod error;
pub mod host;
pub mod launch;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod schedule;
mod transport;
pub mod types;

pub use comm::parse_byte_size;
pub use comm::{
    AbortHandle, Algo, CommBuilder, CommConfig, Communicator, ShmStores, DEFAULT_CHUNK_BYTES,
    DEFAULT_SHM_RING_BYTES, DEFAULT_SHM_STORES_REMEASURE, DEFAULT_TCP_RING_CHUNK_BYTES,
    DEFAULT_TIMEOUT, MAX_TIMEOUT,
};
pub use desc::{BufDesc, Buffer, CollectiveDesc, MemoryKind};
#[cfg(feature = "cuda")]
pub use device::{DeviceBackend, DeviceCommBuilder, DeviceCommunicator, P2pGroup};
pub use error::{Error, RendezvousStage, Result};
pub use half::{bf16, f16};
pub use host::SharedBuffer;
pub use transport::net::TransportKind;
pub use transport::LinkKind;
pub use types::{DType, Element, OpKind, Rank, ReduceOp};
