//! The one place where arguments are checked: every call of every backend
//! builds a [`CollectiveDesc`] and passes [`CollectiveDesc::validate`] before
//! any data moves (NCCL's `ArgsCheck`).

use crate::error::{Error, Result};
use crate::types::{DType, Element, OpKind, Rank, ReduceOp};

/// Where a buffer's memory lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryKind {
    /// Ordinary CPU memory.
    Host,
    /// GPU memory (the `cuda`/`nccl` backends).
    Device,
}

/// A typed buffer a communicator can read from or write to.
///
/// Implemented for host slices and vectors; the GPU backends implement it for
/// device slices, so one [`CollectiveDesc`] and one `validate()` serve both,
/// and the memory kind is checked against the communicator's.
pub trait Buffer<T: Element> {
    /// Number of elements.
    fn elem_count(&self) -> usize;
    /// Where the memory lives.
    fn memory_kind(&self) -> MemoryKind;
}

impl<T: Element> Buffer<T> for [T] {
    fn elem_count(&self) -> usize {
        self.len()
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

impl<T: Element> Buffer<T> for Vec<T> {
    fn elem_count(&self) -> usize {
        self.len()
    }
    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }
}

/// cudarc's device buffers, so one [`CollectiveDesc`] and one `validate()`
/// serve the GPU backends too.
#[cfg(feature = "cuda")]
macro_rules! device_buffer {
    ($($ty:ty),*) => {$(
        impl<T: Element> Buffer<T> for $ty {
            fn elem_count(&self) -> usize {
                cudarc::driver::DeviceSlice::len(self)
            }
            fn memory_kind(&self) -> MemoryKind {
                MemoryKind::Device
            }
        }
    )*};
}

#[cfg(feature = "cuda")]
device_buffer!(
    cudarc::driver::CudaSlice<T>,
    cudarc::driver::CudaView<'_, T>,
    cudarc::driver::CudaViewMut<'_, T>
);

/// Length and memory kind of one buffer of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufDesc {
    /// Number of elements.
    pub len: usize,
    /// Where the memory lives.
    pub memory: MemoryKind,
}

impl BufDesc {
    /// Describes `buf`.
    pub fn of<T: Element, B: Buffer<T> + ?Sized>(buf: &B) -> BufDesc {
        BufDesc {
            len: buf.elem_count(),
            memory: buf.memory_kind(),
        }
    }
}

/// Everything about one call that can be checked without touching its data.
///
/// For an in-place call `send` is `None` and `recv` describes the one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveDesc {
    /// The operation.
    pub op: OpKind,
    /// The element type.
    pub dtype: DType,
    /// The reduction operator, for reducing operations.
    pub reduce_op: Option<ReduceOp>,
    /// The calling rank.
    pub rank: Rank,
    /// The communicator's world size.
    pub world_size: usize,
    /// The memory kind the communicator works on.
    pub memory: MemoryKind,
    /// The input buffer (absent in place and for `recv`).
    pub send: Option<BufDesc>,
    /// The output buffer, or the one buffer in place (absent for `send`).
    pub recv: Option<BufDesc>,
    /// Whether input and output are one buffer.
    pub in_place: bool,
    /// The root of a rooted operation.
    pub root: Option<Rank>,
    /// The peer of a point-to-point operation.
    pub peer: Option<Rank>,
}

impl CollectiveDesc {
    /// A description with no buffers, operator, root or peer yet.
    pub fn new(
        op: OpKind,
        dtype: DType,
        rank: Rank,
        world_size: usize,
        memory: MemoryKind,
    ) -> Self {
        CollectiveDesc {
            op,
            dtype,
            reduce_op: None,
            rank,
            world_size,
            memory,
            send: None,
            recv: None,
            in_place: false,
            root: None,
            peer: None,
        }
    }

    /// Sets the input buffer.
    pub fn with_send(mut self, send: BufDesc) -> Self {
        self.send = Some(send);
        self
    }

    /// Sets the output buffer.
    pub fn with_recv(mut self, recv: BufDesc) -> Self {
        self.recv = Some(recv);
        self
    }

    /// Sets the one buffer of an in-place call.
    pub fn with_in_place(mut self, buf: BufDesc) -> Self {
        self.recv = Some(buf);
        self.send = None;
        self.in_place = true;
        self
    }

    /// Sets the reduction operator.
    pub fn with_reduce_op(mut self, op: ReduceOp) -> Self {
        self.reduce_op = Some(op);
        self
    }

    /// Sets the root.
    pub fn with_root(mut self, root: Rank) -> Self {
        self.root = Some(root);
        self
    }

    /// Sets the peer.
    pub fn with_peer(mut self, peer: Rank) -> Self {
        self.peer = Some(peer);
        self
    }

    fn send_len(&self) -> usize {
        self.send.map_or(0, |b| b.len)
    }

    fn recv_len(&self) -> usize {
        self.recv.map_or(0, |b| b.len)
    }

    /// The call's count in NCCL's sense: elements per rank for all-gather
    /// (send count), reduce-scatter (receive count) and all-to-all (per peer);
    /// the buffer's length otherwise. Meaningful after [`validate`](Self::validate).
    pub fn count(&self) -> usize {
        let world = self.world_size.max(1);
        match self.op {
            OpKind::AllReduce | OpKind::Broadcast | OpKind::Recv => self.recv_len(),
            OpKind::Send => self.send_len(),
            OpKind::Reduce if self.in_place => self.recv_len(),
            OpKind::Reduce => self.send_len(),
            OpKind::ReduceScatter if !self.in_place => self.recv_len(),
            OpKind::AllGather if !self.in_place => self.send_len(),
            OpKind::ReduceScatter | OpKind::AllGather | OpKind::AllToAll | OpKind::Split => {
                self.recv_len() / world
            }
            OpKind::Barrier | OpKind::AllocShared | OpKind::Init => 0,
        }
    }

    /// Total bytes of the call's largest buffer (what nccl-tests calls size;
    /// `usize::MAX` for lengths no memory holds).
    pub fn bytes(&self) -> usize {
        self.send_len()
            .max(self.recv_len())
            .saturating_mul(self.dtype.size())
    }

    fn invalid(&self, arg: &'static str, reason: String) -> Error {
        Error::InvalidArgument {
            op: self.op,
            rank: self.rank,
            arg,
            reason,
        }
    }

    /// Checks the call's arguments. Nothing has moved when this fails.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] naming the operation and the argument when
    /// a buffer has the wrong length or memory kind, a root or peer is out of
    /// range, a point-to-point call names the caller itself, or a reducing
    /// operation has no operator.
    pub fn validate(&self) -> Result<()> {
        let world = self.world_size;
        if world == 0 || self.rank >= world {
            return Err(self.invalid(
                "rank",
                format!("rank {} is not in a world of size {world}", self.rank),
            ));
        }
        for (name, buf) in [("send", self.send), ("recv", self.recv)] {
            if let Some(buf) = buf {
                if buf.memory != self.memory {
                    return Err(self.invalid(
                        name,
                        format!(
                            "{:?} memory given to a communicator that works on {:?} memory",
                            buf.memory, self.memory
                        ),
                    ));
                }
            }
        }
        let needs_op = matches!(
            self.op,
            OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce
        );
        if needs_op && self.reduce_op.is_none() {
            return Err(self.invalid("op", "a reducing operation needs a ReduceOp".into()));
        }
        if let Some(root) = self.root {
            if root >= world {
                return Err(self.invalid(
                    "root",
                    format!("root {root} is out of range for world size {world}"),
                ));
            }
        } else if matches!(self.op, OpKind::Broadcast | OpKind::Reduce) {
            return Err(self.invalid("root", "a rooted operation needs a root".into()));
        }
        if matches!(self.op, OpKind::Send | OpKind::Recv) {
            let peer = self
                .peer
                .ok_or_else(|| self.invalid("peer", "missing".into()))?;
            if peer >= world {
                return Err(self.invalid(
                    "peer",
                    format!("peer {peer} is out of range for world size {world}"),
                ));
            }
            if peer == self.rank {
                return Err(self.invalid(
                    "peer",
                    format!(
                        "rank {peer} cannot {} itself; copy the buffer instead",
                        self.op
                    ),
                ));
            }
        }
        let (send, recv) = (self.send_len(), self.recv_len());
        let is_root = self.root == Some(self.rank);
        match (self.op, self.in_place) {
            // No schedule runs it in place (each round receives into a block
            // a later round still sends), and no API offers it.
            (OpKind::AllToAll, true) => Err(self.invalid(
                "recv",
                "all-to-all has no in-place form; give it separate send and receive buffers"
                    .into(),
            )),
            (OpKind::AllReduce, false) | (OpKind::AllToAll, false) if send != recv => Err(self.invalid(
                "recv",
                format!("recv has {recv} elements but send has {send}; they must be equal"),
            )),
            (OpKind::AllToAll, _) if recv % world != 0 => Err(self.invalid(
                "send",
                format!("{recv} elements do not split into {world} equal blocks, one per rank"),
            )),
            // Checked: the fields are public, and a product that wrapped
            // could equal the other length.
            (OpKind::ReduceScatter, false) if recv.checked_mul(world) != Some(send) => Err(self.invalid(
                "send",
                format!(
                    "send has {send} elements but must have recv ({recv}) × world size ({world}){}",
                    times(recv, world)
                ),
            )),
            (OpKind::AllGather, false) if send.checked_mul(world) != Some(recv) => Err(self.invalid(
                "recv",
                format!(
                    "recv has {recv} elements but must have send ({send}) × world size ({world}){}",
                    times(send, world)
                ),
            )),
            (OpKind::ReduceScatter | OpKind::AllGather, true) if recv % world != 0 => Err(self.invalid(
                "buf",
                format!("{recv} elements do not split into {world} equal parts, one per rank"),
            )),
            (OpKind::Broadcast, false) if is_root && send != recv => Err(self.invalid(
                "send",
                format!("on the root, send has {send} elements but recv has {recv}"),
            )),
            (OpKind::Broadcast, false) if send != 0 && send != recv => Err(self.invalid(
                "send",
                format!(
                    "send is ignored off the root but has {send} elements; pass an empty slice or {recv}"
                ),
            )),
            (OpKind::Reduce, false) if is_root && send != recv => Err(self.invalid(
                "recv",
                format!("on the root, recv has {recv} elements but send has {send}"),
            )),
            (OpKind::Reduce, false) if recv != 0 && recv != send => Err(self.invalid(
                "recv",
                format!(
                    "recv is ignored off the root but has {recv} elements; pass an empty slice or {send}"
                ),
            )),
            _ => Ok(()),
        }
    }
}

/// " = n × world" for a length message, or nothing where the product
/// overflows (no buffer has that many elements).
fn times(n: usize, world: usize) -> String {
    n.checked_mul(world)
        .map(|product| format!(" = {product}"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(len: usize) -> BufDesc {
        BufDesc {
            len,
            memory: MemoryKind::Host,
        }
    }

    fn desc(op: OpKind) -> CollectiveDesc {
        CollectiveDesc::new(op, DType::F32, 1, 4, MemoryKind::Host)
    }

    fn arg_of(result: Result<()>) -> &'static str {
        match result {
            Err(Error::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    /// The fields are public: lengths whose product with the world size
    /// wraps are refused (in debug builds the product panicked; in
    /// release, 2^63 × 4 wrapped to 0 and matched an empty buffer).
    #[test]
    fn lengths_whose_product_overflows_are_refused_not_wrapped() {
        let huge = 1usize << 63;
        let gather = desc(OpKind::AllGather)
            .with_send(host(huge))
            .with_recv(host(0));
        assert_eq!(arg_of(gather.validate()), "recv");
        let scatter = desc(OpKind::ReduceScatter)
            .with_reduce_op(ReduceOp::Sum)
            .with_send(host(0))
            .with_recv(host(huge));
        assert_eq!(arg_of(scatter.validate()), "send");
        assert_eq!(
            desc(OpKind::AllReduce).with_send(host(huge)).bytes(),
            usize::MAX
        );
    }

    #[test]
    fn lengths_are_checked_per_operation() {
        let ar = desc(OpKind::AllReduce).with_reduce_op(ReduceOp::Sum);
        assert!(ar
            .clone()
            .with_send(host(8))
            .with_recv(host(8))
            .validate()
            .is_ok());
        assert_eq!(
            arg_of(ar.with_send(host(8)).with_recv(host(7)).validate()),
            "recv"
        );

        let rs = desc(OpKind::ReduceScatter).with_reduce_op(ReduceOp::Sum);
        assert!(rs
            .clone()
            .with_send(host(12))
            .with_recv(host(3))
            .validate()
            .is_ok());
        assert_eq!(
            arg_of(rs.clone().with_send(host(12)).with_recv(host(4)).validate()),
            "send"
        );
        assert_eq!(arg_of(rs.with_in_place(host(10)).validate()), "buf");

        let ag = desc(OpKind::AllGather);
        assert!(ag
            .clone()
            .with_send(host(3))
            .with_recv(host(12))
            .validate()
            .is_ok());
        assert_eq!(
            arg_of(ag.with_send(host(3)).with_recv(host(11)).validate()),
            "recv"
        );

        let a2a = desc(OpKind::AllToAll);
        assert_eq!(
            arg_of(a2a.clone().with_send(host(6)).with_recv(host(6)).validate()),
            "send"
        );
        assert_eq!(
            arg_of(a2a.with_send(host(8)).with_recv(host(4)).validate()),
            "recv"
        );
    }

    #[test]
    fn roots_and_peers_are_checked() {
        let bc = desc(OpKind::Broadcast)
            .with_send(host(0))
            .with_recv(host(5));
        assert!(bc.clone().with_root(0).validate().is_ok());
        assert_eq!(arg_of(bc.clone().with_root(4).validate()), "root");
        assert_eq!(arg_of(bc.validate()), "root");
        // On the root (rank 1) the send buffer must match.
        let on_root = desc(OpKind::Broadcast)
            .with_root(1)
            .with_send(host(0))
            .with_recv(host(5));
        assert_eq!(arg_of(on_root.validate()), "send");

        let send = desc(OpKind::Send).with_send(host(5));
        assert!(send.clone().with_peer(3).validate().is_ok());
        assert_eq!(arg_of(send.clone().with_peer(4).validate()), "peer");
        assert_eq!(arg_of(send.with_peer(1).validate()), "peer");
    }

    #[test]
    fn memory_kind_and_operator_are_checked() {
        let device = BufDesc {
            len: 4,
            memory: MemoryKind::Device,
        };
        let ar = desc(OpKind::AllReduce).with_reduce_op(ReduceOp::Sum);
        assert_eq!(
            arg_of(ar.with_send(device).with_recv(host(4)).validate()),
            "send"
        );
        let no_op = desc(OpKind::AllReduce)
            .with_send(host(4))
            .with_recv(host(4));
        assert_eq!(arg_of(no_op.validate()), "op");
    }

    #[test]
    fn counts_follow_nccl() {
        let rs = desc(OpKind::ReduceScatter)
            .with_send(host(12))
            .with_recv(host(3));
        assert_eq!(rs.count(), 3);
        let ag_in_place = desc(OpKind::AllGather).with_in_place(host(12));
        assert_eq!(ag_in_place.count(), 3);
        let a2a = desc(OpKind::AllToAll).with_send(host(8)).with_recv(host(8));
        assert_eq!(a2a.count(), 2);
        assert_eq!(a2a.bytes(), 32);
    }

    #[test]
    fn all_to_all_in_place_is_refused() {
        let a2a = desc(OpKind::AllToAll).with_in_place(host(8));
        assert_eq!(arg_of(a2a.validate()), "recv");
    }
}
