//! The host backend: runs schedule plans over a transport with CPU reductions.

pub(crate) mod arena;
pub(crate) mod cpus;
pub(crate) mod executor;
pub mod reduce;
pub mod shared;
pub(crate) mod stream;

pub use shared::SharedBuffer;
