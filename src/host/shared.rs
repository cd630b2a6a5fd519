//! Buffers that oxccl allocates so peers can read and write them directly:
//! [`SharedBuffer`], from [`Communicator::alloc_shared`](crate::Communicator::alloc_shared)
//! — the CPU counterpart of NCCL's `ncclMemAlloc` + symmetric windows.
//!
//! Across processes of one host, every rank creates one shared-memory
//! segment per allocation and maps every peer's: a collective on buffers
//! that every rank allocated in the same allocation runs *zero-copy* — ranks
//! fold straight out of each other's buffers and write each other's outputs,
//! exactly as threads of one process do — instead of staging every byte
//! through the arena's slots. Between threads, and on communicators that
//! have no arena (TCP, `OXCCL_ALGO=ring` or `tree`), the buffer is ordinary memory and
//! every collective works on it as on any slice.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::transport::shm::Segment;
use crate::types::Element;

/// One collective allocation, as this process sees it: its own block and,
/// across processes, every rank's block mapped here.
pub(crate) struct SharedRegion {
    /// The allocation's number on its communicator (equal on every rank).
    pub id: u64,
    /// Bytes of each rank's block.
    pub bytes: usize,
    /// This rank's block.
    pub own: *mut u8,
    /// Every rank's block as mapped in this process (index = rank); empty
    /// for memory only this process's ranks use.
    pub maps: Vec<*mut u8>,
    backing: Backing,
}

enum Backing {
    Heap(std::alloc::Layout),
    /// This rank's segment and the peers' (unmapped on drop).
    Shm(#[allow(dead_code)] Vec<Segment>),
}

// SAFETY: the region is plain memory; who writes which bytes when is the
// business of the collectives (the arena's round protocol) and of the
// `SharedBuffer` borrow rules for its owner.
unsafe impl Send for SharedRegion {}
unsafe impl Sync for SharedRegion {}

impl SharedRegion {
    /// A zeroed, page-aligned block of this process's heap; `None` when
    /// the system will not give that much (an error for the caller to
    /// report, not an abort: the size is the user's).
    pub fn heap(id: u64, bytes: usize) -> Option<SharedRegion> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 4096).ok()?;
        // SAFETY: non-zero size.
        let own = unsafe { std::alloc::alloc_zeroed(layout) };
        (!own.is_null()).then(|| SharedRegion {
            id,
            bytes,
            own,
            maps: Vec::new(),
            backing: Backing::Heap(layout),
        })
    }

    /// A region over every rank's segment (`segments[rank]`, this rank's
    /// among them), each with at least `bytes` of region.
    pub fn mapped(id: u64, bytes: usize, rank: usize, segments: Vec<Segment>) -> SharedRegion {
        let maps: Vec<*mut u8> = segments.iter().map(|s| s.region().0).collect();
        SharedRegion {
            id,
            bytes,
            own: maps[rank],
            maps,
            backing: Backing::Shm(segments),
        }
    }
}

impl Drop for SharedRegion {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated in `heap` with this layout.
            unsafe { std::alloc::dealloc(self.own, layout) };
        }
    }
}

/// `len` elements of memory that peers of its communicator can reach
/// directly (see the [module docs](self)). Dereferences to `[T]`; pass it
/// (or a sub-slice) to any collective. Zeroed when allocated.
///
/// Zero copy across processes needs the buffers a call uses in shared
/// allocations: every rank's input in one and its output in one (off the
/// root, a broadcast's input and a reduce's output are unused and may be
/// empty); other calls run as on any slice. Zero copy holds on the
/// communicator that allocated the buffer: a communicator split from it
/// has its own arena and treats the buffer as ordinary memory (correct,
/// through the slots or CMA); allocate on the sub-communicator for zero
/// copy there. The memory stays valid after the communicator is dropped.
pub struct SharedBuffer<T: Element> {
    region: Arc<SharedRegion>,
    len: usize,
    _elements: PhantomData<T>,
}

impl<T: Element> SharedBuffer<T> {
    pub(crate) fn new(region: Arc<SharedRegion>, len: usize) -> Self {
        debug_assert!(len * std::mem::size_of::<T>() <= region.bytes);
        SharedBuffer {
            region,
            len,
            _elements: PhantomData,
        }
    }

    /// Whether peers in other processes map this buffer (zero copy across
    /// processes), rather than it being ordinary memory.
    pub fn is_mapped_by_peers(&self) -> bool {
        !self.region.maps.is_empty()
    }
}

impl<T: Element> std::ops::Deref for SharedBuffer<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the region holds `len` elements, is page aligned and
        // zero-initialised (valid for every Element type), and lives as
        // long as `self`.
        unsafe { std::slice::from_raw_parts(self.region.own as *const T, self.len) }
    }
}

impl<T: Element> std::ops::DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; `&mut self` is the only handle on this
        // rank's block outside a collective.
        unsafe { std::slice::from_raw_parts_mut(self.region.own as *mut T, self.len) }
    }
}

impl<T: Element> std::fmt::Debug for SharedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedBuffer")
            .field("len", &self.len)
            .field("allocation", &self.region.id)
            .field("mapped_by_peers", &self.is_mapped_by_peers())
            .finish()
    }
}
