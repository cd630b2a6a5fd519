//! The typed device API: [`DeviceCommunicator`], the same operations as the
//! host [`Communicator`](crate::Communicator) on cudarc's device buffers
//! (`CudaSlice<T>`, `CudaView<T>`, `CudaViewMut<T>`), stream-ordered on the
//! communicator's own stream. Two engines run the calls: NCCL (feature
//! `nccl`) and oxccl's own cuda-ring (`src/cuda/`), chosen by
//! `OXCCL_BACKEND=nccl|cuda-ring|auto` or [`DeviceCommBuilder::backend`];
//! the API is the same whichever runs.
//!
//! Every call builds one [`CollectiveDesc`] and passes the same `validate()`
//! as the host API before anything is enqueued; a buffer on another GPU than
//! the communicator's is rejected there too. Calls return once the work is
//! enqueued on [`stream`](DeviceCommunicator::stream); [`synchronize`](DeviceCommunicator::synchronize)
//! waits for it with the communicator's deadline and NCCL's asynchronous
//! error state, so a peer that never arrives is an error, not a hang.
//!
//! Buffers may live on any stream of the same context: cudarc's event
//! tracking makes the communicator's stream wait for their last writes, and
//! their later users wait for the collective.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[cfg(feature = "nccl")]
use cudarc::driver::CudaSlice;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, DriverError};

use crate::bootstrap::{LaunchEnv, PrefixStore, Store};
use crate::comm::{launch_store, Algo, CommConfig};
use crate::cuda::lower::{concat, lower, lower_peer_direct, Lowered};
use crate::cuda::ring::{CallBufs, RingComm, RingGroup};
use crate::desc::{BufDesc, Buffer, CollectiveDesc, MemoryKind};
use crate::error::{as_ranks_store_error, Error, RendezvousStage, Result};
#[cfg(feature = "nccl")]
use crate::nccl::{self, sys, GroupGuard, NcclCall, NcclComm, UniqueId};
use crate::schedule::{self, Family};
use crate::types::{Element, OpKind, Rank, ReduceOp};

/// An error of the CUDA driver, for `rank` doing `context`.
fn cuda_error(rank: Rank, context: impl Into<String>) -> impl FnOnce(DriverError) -> Error {
    let context = context.into();
    move |e| Error::Cuda {
        rank,
        context,
        detail: e.to_string(),
    }
}

/// Opens GPU `ordinal` (its primary context), first checking that the
/// driver library exists: cudarc panics on a missing `libcuda`, we return
/// [`Error::LibraryNotFound`].
pub(crate) fn open_device(rank: Rank, ordinal: Option<usize>) -> Result<Arc<CudaContext>> {
    // SAFETY: only tries to dlopen the driver library under its known names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::LibraryNotFound {
            library: "CUDA driver",
            tried: vec!["libcuda.so, libcuda.so.1 and cudarc's other names".into()],
            hint: "this machine has no NVIDIA driver: GPU communicators need one (the host \
                   Communicator works without)"
                .into(),
        });
    }
    let count = CudaContext::device_count().map_err(cuda_error(rank, "counting CUDA devices"))?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(Error::Cuda {
            rank,
            context: "looking for a GPU".into(),
            detail: "the driver reports no CUDA device (check CUDA_VISIBLE_DEVICES)".into(),
        });
    }
    let ordinal = ordinal.unwrap_or(rank % count);
    if ordinal >= count {
        return Err(Error::Cuda {
            rank,
            context: format!("opening GPU {ordinal}"),
            detail: format!("only {count} CUDA device(s) are visible"),
        });
    }
    CudaContext::new(ordinal).map_err(cuda_error(rank, format!("opening GPU {ordinal}")))
}

/// Each `init` of a device communicator in this process takes the next
/// generation, so several communicators made from one store (in the same
/// order on every rank, as collectives require) use distinct id keys.
static INIT_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Settings for making [`DeviceCommunicator`]s.
#[derive(Clone, Debug, Default)]
pub struct DeviceCommBuilder {
    timeout: Option<Duration>,
    device: Option<usize>,
    job_id: Option<String>,
    backend: Option<DeviceBackend>,
}

impl DeviceCommBuilder {
    /// How long initialisation, split, finalisation and
    /// [`synchronize`](DeviceCommunicator::synchronize) may wait (default
    /// `OXCCL_TIMEOUT`, else 60 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Which GPU this rank drives (default: the launcher's local rank modulo
    /// the visible GPUs, or the rank modulo them for [`init`](Self::init)).
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// Distinguishes jobs sharing one store (default `OXCCL_JOB_ID`).
    pub fn job_id(mut self, id: impl Into<String>) -> Self {
        self.job_id = Some(id.into());
        self
    }

    /// Which engine runs the calls (default `OXCCL_BACKEND`, else `auto`).
    pub fn backend(mut self, backend: DeviceBackend) -> Self {
        self.backend = Some(backend);
        self
    }

    fn chosen_backend(&self) -> Result<DeviceBackend> {
        match self.backend {
            Some(b) => Ok(b),
            None => DeviceBackend::from_env(),
        }
    }

    /// The engine for ranks in separate processes. Every rank must run the
    /// same one, so with `auto` rank 0 decides (NCCL when it loads there,
    /// else the cuda-ring) and publishes the choice in the store.
    fn process_backend(
        &self,
        rank: Rank,
        store: &dyn Store,
        prefix: &str,
        timeout: Duration,
    ) -> Result<DeviceBackend> {
        // Rank 0 always publishes what it runs, so a rank left on `auto`
        // follows it even when rank 0 was told explicitly, and a rank told
        // explicitly is checked against it.
        let key = format!("{prefix}/backend");
        let mine = self.chosen_backend()?;
        let chosen = if rank == 0 {
            let resolved = match mine {
                DeviceBackend::Auto => auto_backend()?,
                other => other,
            };
            store
                .set(&key, resolved.name().as_bytes())
                .map_err(|e| as_ranks_store_error(e, rank, "publishing the device backend"))?;
            resolved
        } else {
            let name =
                published_by_rank0(store, (rank, RendezvousStage::BackendChoice), &key, timeout)?;
            let name = String::from_utf8_lossy(&name).into_owned();
            let rank0 = DeviceBackend::from_name(&name).ok_or_else(|| Error::Config {
                name: "OXCCL_BACKEND".into(),
                value: name.clone(),
                reason: "rank 0 published a backend this rank does not know".into(),
            })?;
            // A rank told another backend than rank 0 runs would start a
            // set-up nobody else joins, and wait out its timeout.
            if mine != DeviceBackend::Auto && mine != rank0 {
                return Err(Error::Config {
                    name: "OXCCL_BACKEND".into(),
                    value: mine.name().into(),
                    reason: format!(
                        "rank {rank} was told {} but rank 0 runs {}: every rank must use \
                         the same backend (or auto, to follow rank 0)",
                        mine.name(),
                        rank0.name()
                    ),
                });
            }
            rank0
        };
        match chosen {
            DeviceBackend::Nccl if !cfg!(feature = "nccl") => Err(Error::Config {
                name: "OXCCL_BACKEND".into(),
                value: "nccl".into(),
                reason: "this build has no NCCL backend (feature `nccl`): use cuda-ring or auto"
                    .into(),
            }),
            DeviceBackend::CudaRing => {
                log_choice("cuda-ring (ranks in separate processes, CUDA IPC)");
                Ok(chosen)
            }
            _ => {
                log_choice("nccl (ranks in separate processes)");
                Ok(DeviceBackend::Nccl)
            }
        }
    }

    fn job(&self) -> Result<String> {
        Ok(self
            .job_id
            .clone()
            .map_or_else(|| crate::comm::env_value("OXCCL_JOB_ID"), |id| Ok(Some(id)))?
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| "default".into()))
    }

    fn config_timeout(&self) -> Result<Duration> {
        Ok(crate::comm::bounded_timeout(match self.timeout {
            Some(t) => t,
            None => CommConfig::from_env()?.timeout,
        }))
    }

    /// Joins a job of `world_size` ranks as `rank`, one process each.
    ///
    /// With NCCL, rank 0 makes the NCCL unique id and publishes it in
    /// `store`; every rank reads it and starts `ncclCommInitRankConfig`
    /// (non-blocking), and waits for it with the deadline. With the
    /// cuda-ring, the ranks make a host communicator through `store` (keys
    /// under their own prefix) that carries the CUDA IPC handles of their
    /// inboxes and events; every rank must be on one host. With `auto`,
    /// rank 0 picks NCCL when it loads, else the cuda-ring, for everyone.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a rank out of range;
    /// [`Error::LibraryNotFound`] / [`Error::LibraryUnsupported`] when NCCL
    /// or the driver is missing or too old; [`Error::Cuda`] when no GPU can
    /// be opened; [`Error::RendezvousTimeout`] when rank 0 never publishes
    /// the id; [`Error::DeviceTimeout`] when NCCL's set-up does not finish
    /// (a rank that never starts); [`Error::Nccl`] with NCCL's text;
    /// [`Error::Config`] for cuda-ring ranks on several hosts.
    pub fn init(
        &self,
        rank: Rank,
        world_size: usize,
        store: Arc<dyn Store>,
    ) -> Result<DeviceCommunicator> {
        self.init_on(rank, world_size, store, self.device)
    }

    fn init_on(
        &self,
        rank: Rank,
        world_size: usize,
        store: Arc<dyn Store>,
        device: Option<usize>,
    ) -> Result<DeviceCommunicator> {
        let timeout = self.config_timeout()?;
        crate::comm::check_rank(rank, world_size)?;
        let generation = INIT_GENERATION.fetch_add(1, Ordering::Relaxed);
        let job = self.job()?;
        let prefix = format!("oxccl/device/{job}/{generation}");
        match self.process_backend(rank, &*store, &prefix, timeout)? {
            DeviceBackend::CudaRing => {
                let ctx = open_device(rank, device)?;
                let control = crate::comm::CommBuilder::default()
                    .timeout(timeout)
                    .algo(crate::comm::Algo::Ring)
                    .job_id(format!("{job}-cuda-ring-{generation}"))
                    .init(
                        rank,
                        world_size,
                        Arc::new(PrefixStore::new(format!("{prefix}/control"), store)),
                    )?;
                let settings = ring_settings_from_env()?;
                let ring = RingComm::new_remote(control, ctx, timeout)?;
                Ok(DeviceCommunicator::assemble_ring(ring, timeout, settings))
            }
            _ => self.nccl_init(rank, world_size, store, device, &prefix, timeout),
        }
    }

    #[cfg(not(feature = "nccl"))]
    fn nccl_init(
        &self,
        _rank: Rank,
        _world_size: usize,
        _store: Arc<dyn Store>,
        _device: Option<usize>,
        _prefix: &str,
        _timeout: Duration,
    ) -> Result<DeviceCommunicator> {
        // `process_backend` refuses NCCL in builds without it.
        Err(Error::Config {
            name: "OXCCL_BACKEND".into(),
            value: "nccl".into(),
            reason: "this build has no NCCL backend (feature `nccl`)".into(),
        })
    }

    #[cfg(feature = "nccl")]
    fn nccl_init(
        &self,
        rank: Rank,
        world_size: usize,
        store: Arc<dyn Store>,
        device: Option<usize>,
        prefix: &str,
        timeout: Duration,
    ) -> Result<DeviceCommunicator> {
        crate::nccl::refuse_setup_inside_open_group(rank)?;
        let library = sys::library()?;
        let ctx = open_device(rank, device)?;
        ctx.bind_to_thread()
            .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
        let key = format!("{prefix}/unique-id");
        let id = if rank == 0 {
            let id = UniqueId::new()?;
            store
                .set(&key, id.as_bytes())
                .map_err(|e| as_ranks_store_error(e, rank, "publishing NCCL's unique id"))?;
            id
        } else {
            let stage = (rank, RendezvousStage::NcclUniqueId);
            UniqueId::from_bytes(&published_by_rank0(&*store, stage, &key, timeout)?)?
        };
        let mut comm = NcclComm::start_init(library, &id, rank, world_size, timeout)?;
        comm.wait_ready(
            "ncclCommInitRankConfig",
            &format!(
                "rank {rank} of {world_size} on GPU {}: waiting for every rank to join",
                ctx.ordinal()
            ),
        )?;
        DeviceCommunicator::assemble(ctx, comm, timeout)
    }

    /// Joins the job the launcher describes (torchrun / `oxccl-run`, Open
    /// MPI, Slurm variables, as [`Communicator::from_env`](crate::Communicator::from_env)),
    /// on GPU `LOCAL_RANK` modulo the visible GPUs unless [`device`](Self::device) says otherwise.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for missing or contradictory variables; as
    /// [`init`](Self::init).
    pub fn from_env(&self) -> Result<DeviceCommunicator> {
        let env = LaunchEnv::from_env()?;
        let (store, _) = launch_store(&env, self.config_timeout()?)?;
        let mut builder = self.clone();
        if builder.job_id.is_none() {
            builder.job_id = env.job_id.clone();
        }
        let device = self.device.or(Some(env.local_rank));
        let device = match device {
            Some(d) if self.device.is_none() => {
                // LOCAL_RANK modulo the visible GPUs, as torchrun users expect.
                let count = visible_devices(env.rank)?;
                Some(d % count.max(1))
            }
            other => other,
        };
        builder.init_on(env.rank, env.world_size, store, device)
    }

    /// `n` communicators of one process, rank `i` on GPU `i` (NCCL's
    /// `ncclCommInitAll`, done as one group of non-blocking
    /// `ncclCommInitRankConfig` so the deadline holds). Hand each to its own
    /// thread.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for `n == 0` or more than a job's ranks
    /// (65 536); [`Error::Cuda`] when fewer
    /// than `n` GPUs are visible (NCCL refuses two ranks on one GPU); as
    /// [`init`](Self::init).
    pub fn local_group(&self, n: usize) -> Result<Vec<DeviceCommunicator>> {
        let timeout = self.config_timeout()?;
        // At most a job's world size, as `init` and the host's
        // `local_group` allow (the cuda-ring group sizes an n × n table).
        crate::comm::check_rank(0, n.max(1))?;
        if n == 0 {
            return Err(Error::InvalidArgument {
                op: OpKind::Split,
                rank: 0,
                arg: "n",
                reason: "a group needs at least one rank".into(),
            });
        }
        match self.chosen_backend()? {
            DeviceBackend::CudaRing => self.ring_local_group(n, timeout),
            DeviceBackend::Nccl => self.nccl_local_group(n, timeout),
            DeviceBackend::Auto => {
                // NCCL when it loads and there is a GPU per rank (it refuses
                // two ranks on one GPU); otherwise the cuda-ring.
                #[cfg(feature = "nccl")]
                if auto_backend()? == DeviceBackend::Nccl {
                    if visible_devices(0)? >= n {
                        return self.nccl_local_group(n, timeout);
                    }
                    log_choice("cuda-ring: fewer GPUs than ranks, which NCCL refuses");
                }
                self.ring_local_group(n, timeout)
            }
        }
    }

    /// `n` cuda-ring ranks, rank `i` on GPU `i` modulo the visible GPUs.
    fn ring_local_group(&self, n: usize, timeout: Duration) -> Result<Vec<DeviceCommunicator>> {
        let count = visible_devices(0)?;
        let settings = ring_settings_from_env()?;
        let contexts = (0..n)
            .map(|i| open_device(i, Some(i % count.max(1))))
            .collect::<Result<Vec<_>>>()?;
        log_choice(&format!("cuda-ring, {n} ranks on {} GPU(s)", count.min(n)));
        let group = RingGroup::new(&contexts)?;
        contexts
            .into_iter()
            .enumerate()
            .map(|(rank, ctx)| {
                RingComm::new(group.clone(), rank, ctx, timeout)
                    .map(|ring| DeviceCommunicator::assemble_ring(ring, timeout, settings))
            })
            .collect()
    }

    #[cfg(not(feature = "nccl"))]
    fn nccl_local_group(&self, _n: usize, _timeout: Duration) -> Result<Vec<DeviceCommunicator>> {
        Err(Error::Config {
            name: "OXCCL_BACKEND".into(),
            value: "nccl".into(),
            reason: "this build has no NCCL backend (feature `nccl`): use cuda-ring or auto".into(),
        })
    }

    #[cfg(feature = "nccl")]
    fn nccl_local_group(&self, n: usize, timeout: Duration) -> Result<Vec<DeviceCommunicator>> {
        crate::nccl::refuse_setup_inside_open_group(0)?;
        log_choice(&format!("nccl, {n} ranks, one GPU each"));
        let library = sys::library()?;
        let count = visible_devices(0)?;
        if count < n {
            return Err(Error::Cuda {
                rank: 0,
                context: format!("making a group of {n} GPU communicators"),
                detail: format!(
                    "only {count} CUDA device(s) are visible; NCCL needs one GPU per rank \
                     (\"Duplicate GPU detected\")"
                ),
            });
        }
        let contexts = (0..n)
            .map(|i| open_device(i, Some(i)))
            .collect::<Result<Vec<_>>>()?;
        let id = UniqueId::new()?;
        let mut comms = Vec::with_capacity(n);
        let group = GroupGuard::start(library, 0)?;
        for (rank, ctx) in contexts.iter().enumerate() {
            ctx.bind_to_thread()
                .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
            comms.push(NcclComm::start_init(library, &id, rank, n, timeout)?);
        }
        let rc = group.end();
        let mut out: Vec<DeviceCommunicator> = Vec::with_capacity(n);
        let mut pending = contexts.into_iter().zip(comms);
        while let Some((ctx, mut comm)) = pending.next() {
            let rank = comm.rank();
            let detail = format!("group of {n} communicators, rank {rank} on GPU {rank}");
            let ready = ctx
                .bind_to_thread()
                .map_err(cuda_error(rank, "binding the GPU to this thread"))
                .and_then(|()| comm.finish_call("ncclGroupEnd", rc, &detail))
                .and_then(|()| comm.wait_ready("ncclCommInitRankConfig", &detail));
            if let Err(e) = ready {
                // The others of the group cannot finish their set-up
                // without this one: abort them now. Dropped as they are,
                // each would first try to finalize, one timeout apiece.
                comm.abort();
                for (_, mut rest) in pending {
                    rest.abort();
                }
                for made in &mut out {
                    if let Engine::Nccl { comm, .. } = &mut made.engine {
                        comm.abort();
                    }
                }
                return Err(e);
            }
            out.push(DeviceCommunicator::assemble(ctx, comm, timeout)?);
        }
        Ok(out)
    }
}

/// The value rank 0 publishes at `key` (the backend it runs, NCCL's unique
/// id: `stage`), waited for by `rank` with the deadline:
/// `RendezvousTimeout` naming rank 0; the store's errors name `rank`.
fn published_by_rank0(
    store: &dyn Store,
    (rank, stage): (Rank, RendezvousStage),
    key: &str,
    timeout: Duration,
) -> Result<Vec<u8>> {
    let what = "waiting for rank 0's set-up";
    let missing = store
        .wait(&[key.to_owned()], timeout)
        .map_err(|e| as_ranks_store_error(e, rank, what))?;
    if !missing.is_empty() {
        return Err(Error::RendezvousTimeout {
            rank,
            store: store.describe(),
            waited: timeout,
            stage,
            missing: vec![0],
        });
    }
    Ok(store
        .try_get(key)
        .map_err(|e| as_ranks_store_error(e, rank, what))?
        .unwrap_or_default())
}

/// The number of GPUs the driver shows, with a clear error when it shows none.
fn visible_devices(rank: Rank) -> Result<usize> {
    let ctx_probe = open_device(rank, None)?;
    drop(ctx_probe);
    let count = CudaContext::device_count().map_err(cuda_error(rank, "counting CUDA devices"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Which engine runs a [`DeviceCommunicator`]'s calls (`OXCCL_BACKEND`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceBackend {
    /// NCCL when it loads (and, for a local group, there is a GPU per
    /// rank), else the cuda-ring.
    #[default]
    Auto,
    /// NCCL (feature `nccl`).
    Nccl,
    /// oxccl's own ring over CUDA kernels: no NCCL needed; ranks are
    /// threads of one process or processes of one host (CUDA IPC),
    /// several per GPU allowed.
    CudaRing,
}

/// What `auto` means: NCCL when it loads, else the cuda-ring (logged with
/// `OXCCL_DEBUG=INFO`). A library named by `OXCCL_NCCL_LIBRARY` that does
/// not load is an error, not a reason to fall back: the user asked for it.
fn auto_backend() -> Result<DeviceBackend> {
    #[cfg(feature = "nccl")]
    match sys::library() {
        Ok(_) => return Ok(DeviceBackend::Nccl),
        Err(e) if std::env::var_os(sys::LIBRARY_VARIABLE).is_some() => return Err(e),
        Err(e) => log_choice(&format!("cuda-ring: NCCL is not available ({e})")),
    }
    Ok(DeviceBackend::CudaRing)
}

impl DeviceBackend {
    /// The name `OXCCL_BACKEND` takes for it.
    pub fn name(self) -> &'static str {
        match self {
            DeviceBackend::Auto => "auto",
            DeviceBackend::Nccl => "nccl",
            DeviceBackend::CudaRing => "cuda-ring",
        }
    }

    /// Parses `OXCCL_BACKEND`'s values: `auto`, `nccl`, `cuda-ring`.
    pub fn from_name(name: &str) -> Option<DeviceBackend> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(DeviceBackend::Auto),
            "nccl" => Some(DeviceBackend::Nccl),
            "cuda-ring" | "cuda_ring" | "ring" => Some(DeviceBackend::CudaRing),
            _ => None,
        }
    }

    fn from_env() -> Result<DeviceBackend> {
        match crate::comm::env_value("OXCCL_BACKEND")? {
            Some(v) => DeviceBackend::from_name(&v).ok_or_else(|| Error::Config {
                name: "OXCCL_BACKEND".into(),
                value: v,
                reason: "expected auto, nccl or cuda-ring".into(),
            }),
            None => Ok(DeviceBackend::Auto),
        }
    }
}

/// Says which backend a group was given, with `OXCCL_DEBUG=INFO`.
fn log_choice(what: &str) {
    if crate::comm::debug_info() {
        crate::comm::info_line(format_args!("backend: {what}"));
    }
}

/// The engine behind a device communicator.
enum Engine {
    #[cfg(feature = "nccl")]
    Nccl {
        comm: NcclComm,
        /// One element for [`barrier`](DeviceCommunicator::barrier): NCCL
        /// has none, so a barrier is a one-element all-reduce and a wait
        /// for the stream.
        barrier_cell: CudaSlice<f32>,
    },
    // Boxed: a ring rank holds its inboxes and links inline.
    Ring(Box<RingComm>),
}

/// A communicator over GPU buffers: see the [module docs](self).
///
/// `Send`, not `Sync`: one thread drives it at a time (NCCL's rule).
pub struct DeviceCommunicator {
    rank: Rank,
    world: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    engine: Engine,
    /// Pipeline piece size of the cuda-ring's schedules.
    chunk_bytes: usize,
    /// The cuda-ring's algorithm setting (`OXCCL_ALGO`): `Ring` keeps every
    /// call on the ring; otherwise all-reduce, reduce-scatter,
    /// all-gather and broadcast run peer-direct where the ranks allow it.
    ring_algo: Algo,
    timeout: Duration,
    /// Collective calls made so far (the number errors carry).
    seq: u64,
    /// The first error: after it the communicator refuses every call.
    failed: Option<String>,
}

impl std::fmt::Debug for DeviceCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCommunicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("gpu", &self.ctx.ordinal())
            .field("backend", &self.backend_name())
            .finish()
    }
}

impl DeviceCommunicator {
    /// Settings for [`init`](DeviceCommBuilder::init),
    /// [`from_env`](DeviceCommBuilder::from_env) and
    /// [`local_group`](DeviceCommBuilder::local_group).
    pub fn builder() -> DeviceCommBuilder {
        DeviceCommBuilder::default()
    }

    /// [`DeviceCommBuilder::init`] with default settings.
    ///
    /// # Errors
    ///
    /// As [`DeviceCommBuilder::init`].
    pub fn init(rank: Rank, world_size: usize, store: Arc<dyn Store>) -> Result<Self> {
        Self::builder().init(rank, world_size, store)
    }

    /// [`DeviceCommBuilder::from_env`] with default settings.
    ///
    /// # Errors
    ///
    /// As [`DeviceCommBuilder::from_env`].
    pub fn from_env() -> Result<Self> {
        Self::builder().from_env()
    }

    /// [`DeviceCommBuilder::local_group`] with default settings.
    ///
    /// # Errors
    ///
    /// As [`DeviceCommBuilder::local_group`].
    pub fn local_group(n: usize) -> Result<Vec<Self>> {
        Self::builder().local_group(n)
    }

    #[cfg(feature = "nccl")]
    fn assemble(ctx: Arc<CudaContext>, nccl: NcclComm, timeout: Duration) -> Result<Self> {
        let rank = nccl.rank();
        let stream = ctx
            .new_stream()
            .map_err(cuda_error(rank, "creating the communicator's stream"))?;
        let barrier_cell = stream
            .alloc_zeros::<f32>(1)
            .map_err(cuda_error(rank, "allocating the barrier's element"))?;
        Ok(DeviceCommunicator {
            rank,
            world: nccl.world(),
            ctx,
            stream,
            engine: Engine::Nccl {
                comm: nccl,
                barrier_cell,
            },
            chunk_bytes: RING_CHUNK_BYTES,
            ring_algo: Algo::Auto,
            timeout,
            seq: 0,
            failed: None,
        })
    }

    fn assemble_ring(ring: RingComm, timeout: Duration, settings: RingSettings) -> Self {
        DeviceCommunicator {
            rank: ring.rank(),
            world: ring.world(),
            ctx: ring.context().clone(),
            stream: ring.stream().clone(),
            engine: Engine::Ring(Box::new(ring)),
            chunk_bytes: settings.chunk_bytes,
            ring_algo: settings.algo,
            timeout,
            seq: 0,
            failed: None,
        }
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.world
    }

    /// The GPU this rank drives.
    pub fn device_ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The stream every call is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA context (the GPU's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Which backend runs the calls: `nccl` or `cuda-ring`.
    pub fn backend_name(&self) -> &'static str {
        match self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { .. } => "nccl",
            Engine::Ring(_) => "cuda-ring",
        }
    }

    /// The algorithm a call of `op` runs, for reports: `nccl`, or on the
    /// cuda-ring `peer-direct` or `ring`.
    pub fn algorithm_for(&self, op: OpKind) -> &'static str {
        match &self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { .. } => "nccl",
            Engine::Ring(ring) => {
                // An empty call of `op` lowers as any call of it would.
                let desc = CollectiveDesc::new(
                    op,
                    crate::DType::U8,
                    self.rank,
                    self.world,
                    MemoryKind::Device,
                );
                let direct =
                    peer_direct_allowed(ring, self.ring_algo) && lower_peer_direct(&desc).is_some();
                if direct {
                    "peer-direct"
                } else {
                    "ring"
                }
            }
        }
    }

    /// The backend with its version or paths, for reports: `NCCL 2.32.3`,
    /// `cuda-ring (same GPU)`.
    pub fn backend_description(&self) -> String {
        match &self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, .. } => format!("NCCL {}", comm.library().version),
            Engine::Ring(ring) => format!("cuda-ring ({})", ring.paths_summary()),
        }
    }

    /// The NCCL in use, when NCCL runs the calls.
    #[cfg(feature = "nccl")]
    pub fn nccl_version(&self) -> Option<nccl::NcclVersion> {
        match &self.engine {
            Engine::Nccl { comm, .. } => Some(comm.library().version),
            Engine::Ring(_) => None,
        }
    }

    /// Aborts the communicator: with NCCL `ncclCommAbort` (work in flight
    /// on the GPU for it stops); with the cuda-ring, every rank of the group
    /// stops waiting and fails. Every later call fails.
    pub fn abort(&mut self) {
        match &mut self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, .. } => comm.abort(),
            Engine::Ring(ring) => ring.abort(),
        }
        self.failed.get_or_insert_with(|| "aborted".into());
    }

    /// One look at the engine's asynchronous state while waiting.
    fn poll_engine(&mut self) -> Result<()> {
        match &mut self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, .. } => comm.poll("the communicator's collectives").map(|_| ()),
            Engine::Ring(ring) => ring.check_aborted(OpKind::Barrier),
        }
    }

    /// Waits until everything enqueued on the communicator's stream has run,
    /// polling NCCL's asynchronous error state (or the cuda-ring group's);
    /// past the deadline the communicator is aborted.
    ///
    /// # Errors
    ///
    /// [`Error::Nccl`] for an asynchronous NCCL failure (including
    /// `ncclRemoteError` when a peer failed); [`Error::DeviceTimeout`] on
    /// expiry; [`Error::Cuda`] for a driver failure.
    pub fn synchronize(&mut self) -> Result<()> {
        let what = format!("stream holding collective #{}", self.seq.saturating_sub(1));
        let result = self.wait_stream(&what);
        if let Err(e) = &result {
            self.failed.get_or_insert_with(|| e.to_string());
        }
        result
    }

    fn wait_stream(&mut self, what: &str) -> Result<()> {
        let rank = self.rank;
        let done = self
            .stream
            .record_event(None)
            .map_err(cuda_error(rank, "recording an event on the stream"))?;
        let start = Instant::now();
        loop {
            if done
                .try_is_complete()
                .map_err(cuda_error(rank, "querying the stream"))?
            {
                return Ok(());
            }
            self.poll_engine()?;
            if start.elapsed() >= self.timeout {
                self.abort();
                return Err(Error::DeviceTimeout {
                    rank,
                    what: what.to_owned(),
                    waited: start.elapsed(),
                });
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    fn desc<T: Element>(&self, op: OpKind) -> CollectiveDesc {
        CollectiveDesc::new(op, T::DTYPE, self.rank, self.world, MemoryKind::Device)
    }

    /// The one check every call makes before enqueueing: the shared
    /// `validate()`, that the communicator is still usable, and that every
    /// buffer (known by the stream it belongs to) lives on this
    /// communicator's GPU.
    fn admit(&self, desc: &CollectiveDesc, streams: &[Arc<CudaStream>]) -> Result<()> {
        let ordinals: Vec<usize> = streams.iter().map(|s| s.context().ordinal()).collect();
        desc.validate()?;
        if let Some(first) = &self.failed {
            return Err(Error::Failed {
                op: desc.op,
                rank: self.rank,
                first_error: first.clone(),
            });
        }
        check_same_device(desc, self.ctx.ordinal(), &ordinals)
    }

    /// Makes the communicator's stream wait for the work already queued on
    /// each buffer's own stream. cudarc's event tracking does this only for
    /// buffers of the same `CudaContext` value, and a user's legacy default
    /// stream does not order against our non-blocking one, so streams other
    /// than ours are joined explicitly (one event each).
    fn wait_for_buffers(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        for s in streams.iter().filter(|s| ***s != *self.stream) {
            self.stream
                .join(s)
                .map_err(cuda_error(self.rank, "ordering after the buffer's stream"))?;
        }
        Ok(())
    }

    /// Makes each buffer's own stream wait for the call just enqueued, so
    /// its later users (and cudarc's stream-ordered free) come after it.
    fn release_buffers(&self, streams: &[Arc<CudaStream>]) -> Result<()> {
        for s in streams.iter().filter(|s| ***s != *self.stream) {
            s.join(&self.stream).map_err(cuda_error(
                self.rank,
                "ordering the buffer's stream after the call",
            ))?;
        }
        Ok(())
    }

    /// Refuses an NCCL call while a [`P2pGroup`] of any NCCL communicator
    /// is open on this thread: NCCL's group state is the thread's, so the
    /// call would join that group and run only at its end, after this call
    /// had returned (its buffers freed, `synchronize` passed, meanwhile).
    fn refuse_inside_open_group(&self, op: OpKind) -> Result<()> {
        #[cfg(feature = "nccl")]
        if matches!(self.engine, Engine::Nccl { .. }) && crate::nccl::group_open_on_this_thread() {
            return Err(Error::InvalidArgument {
                op,
                rank: self.rank,
                arg: "self",
                reason: "a P2pGroup is open on this thread, and NCCL would defer this call to \
                         the group's end; end the group first"
                    .into(),
            });
        }
        let _ = op;
        Ok(())
    }

    /// Enqueues a validated call. `send`/`recv` are device addresses (0 for
    /// a buffer the call does not have).
    fn enqueue(
        &mut self,
        desc: &CollectiveDesc,
        elem_bytes: usize,
        (send, recv): (u64, u64),
        streams: &[Arc<CudaStream>],
    ) -> Result<()> {
        // Before any state changes: a refused call leaves the communicator
        // as it was.
        self.refuse_inside_open_group(desc.op)?;
        let result = self
            .wait_for_buffers(streams)
            .and_then(|()| self.enqueue_inner(desc, elem_bytes, send, recv))
            .and_then(|()| self.release_buffers(streams));
        self.seq += 1;
        if let Err(e) = &result {
            self.failed.get_or_insert_with(|| e.to_string());
        }
        result
    }

    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    fn enqueue_inner(
        &mut self,
        desc: &CollectiveDesc,
        elem_bytes: usize,
        send: u64,
        recv: u64,
    ) -> Result<()> {
        let rank = self.rank;
        self.ctx
            .bind_to_thread()
            .map_err(cuda_error(rank, "binding the GPU to this thread"))?;
        match &mut self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, barrier_cell } => {
                let call = NcclEnqueue {
                    stream: &self.stream,
                    seq: self.seq,
                    elem_bytes,
                };
                call.run(comm, barrier_cell, desc, send, recv)
            }
            Engine::Ring(ring) => {
                let lowered = ring_lowering(ring, self.ring_algo, desc, self.chunk_bytes);
                ring.run(
                    desc.op,
                    desc.dtype,
                    desc.reduce_op.unwrap_or(ReduceOp::Sum),
                    &lowered,
                    &[CallBufs { send, recv }],
                )
            }
        }
    }

    /// All-reduce: `recv[i]` = `op` over every rank's `send[i]`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for unequal lengths or a buffer on another
    /// GPU, before anything is enqueued; [`Error::Nccl`] with NCCL's text.
    pub fn all_reduce<T, S, R>(&mut self, send: &S, recv: &mut R, op: ReduceOp) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::AllReduce)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op);
        self.out_of_place(desc, send, recv)
    }

    /// All-reduce in place.
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_in_place<T, B>(&mut self, buf: &mut B, op: ReduceOp) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::AllReduce)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op);
        self.in_place(desc, buf)
    }

    /// Reduce-scatter: `recv` = block `rank` of `op` over every rank's `send`
    /// (`send.len() == recv.len() * world_size()`).
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter<T, S, R>(&mut self, send: &S, recv: &mut R, op: ReduceOp) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::ReduceScatter)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op);
        self.out_of_place(desc, send, recv)
    }

    /// Reduce-scatter in place: the result lands in block `rank` of `buf`.
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter_in_place<T, B>(&mut self, buf: &mut B, op: ReduceOp) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::ReduceScatter)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op);
        self.in_place(desc, buf)
    }

    /// All-gather: `recv` is every rank's `send` in rank order.
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather<T, S, R>(&mut self, send: &S, recv: &mut R) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::AllGather)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv));
        self.out_of_place(desc, send, recv)
    }

    /// All-gather in place: this rank's part is already in block `rank` of `buf`.
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_gather_in_place<T, B>(&mut self, buf: &mut B) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::AllGather)
            .with_in_place(BufDesc::of(buf));
        self.in_place(desc, buf)
    }

    /// Broadcast: every rank's `recv` becomes the root's `send` (off the
    /// root `send` is not read and may be empty).
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce), and for a root out of range.
    pub fn broadcast<T, S, R>(&mut self, send: &S, recv: &mut R, root: Rank) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Broadcast)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_root(root);
        self.out_of_place(desc, send, recv)
    }

    /// Broadcast in place.
    ///
    /// # Errors
    ///
    /// As [`broadcast`](Self::broadcast).
    pub fn broadcast_in_place<T, B>(&mut self, buf: &mut B, root: Rank) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Broadcast)
            .with_in_place(BufDesc::of(buf))
            .with_root(root);
        self.in_place(desc, buf)
    }

    /// Reduce: the root's `recv` = `op` over every rank's `send` (off the
    /// root `recv` is not written and may be empty).
    ///
    /// # Errors
    ///
    /// As [`broadcast`](Self::broadcast).
    pub fn reduce<T, S, R>(
        &mut self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        root: Rank,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Reduce)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv))
            .with_reduce_op(op)
            .with_root(root);
        self.out_of_place(desc, send, recv)
    }

    /// Reduce in place: the root's `buf` becomes the reduction.
    ///
    /// # Errors
    ///
    /// As [`broadcast`](Self::broadcast).
    pub fn reduce_in_place<T, B>(&mut self, buf: &mut B, op: ReduceOp, root: Rank) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Reduce)
            .with_in_place(BufDesc::of(buf))
            .with_reduce_op(op)
            .with_root(root);
        self.in_place(desc, buf)
    }

    /// All-to-all: block `p` of `send` goes to rank `p`, block `p` of `recv`
    /// comes from rank `p` (one NCCL group of sends and receives).
    ///
    /// # Errors
    ///
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_to_all<T, S, R>(&mut self, send: &S, recv: &mut R) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::AllToAll)
            .with_send(BufDesc::of(send))
            .with_recv(BufDesc::of(recv));
        self.out_of_place(desc, send, recv)
    }

    /// Sends `buf` to `peer`, which calls [`recv`](Self::recv) with the same
    /// length. Stream-ordered: the transfer runs when both sides' streams
    /// reach it; several sends and receives that must run together (a
    /// pipeline exchanging with both neighbours) go in one [`group`](Self::group).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a peer out of range or equal to this rank.
    pub fn send<T, S>(&mut self, buf: &S, peer: Rank) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Send)
            .with_send(BufDesc::of(buf))
            .with_peer(peer);
        let streams = [DeviceSlice::stream(buf).clone()];
        self.admit(&desc, &streams)?;
        let stream = self.stream.clone();
        let (ptr, _record) = buf.device_ptr(&stream);
        self.enqueue(&desc, T::DTYPE.size(), (ptr, 0), &streams)
    }

    /// Receives `buf.len()` elements from `peer`.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub fn recv<T, R>(&mut self, buf: &mut R, peer: Rank) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .desc::<T>(OpKind::Recv)
            .with_recv(BufDesc::of(buf))
            .with_peer(peer);
        let streams = [DeviceSlice::stream(buf).clone()];
        self.admit(&desc, &streams)?;
        let stream = self.stream.clone();
        let (ptr, _record) = buf.device_ptr_mut(&stream);
        self.enqueue(&desc, T::DTYPE.size(), (0, ptr), &streams)
    }

    /// Returns once every rank has reached the barrier and this rank's
    /// stream has drained (a one-element all-reduce, then
    /// [`synchronize`](Self::synchronize)).
    ///
    /// # Errors
    ///
    /// As [`synchronize`](Self::synchronize).
    pub fn barrier(&mut self) -> Result<()> {
        let desc = self.desc::<f32>(OpKind::Barrier);
        self.admit(&desc, &[])?;
        self.enqueue(&desc, 4, (0, 0), &[])?;
        self.synchronize()
    }

    /// Opens a group of point-to-point calls launched together at
    /// [`P2pGroup::end`] (NCCL's `ncclGroupStart`/`ncclGroupEnd`; on the
    /// cuda-ring, one call holding every send, then every receive). Use it
    /// whenever ranks exchange both ways: a lone `send` waits until its
    /// receiver has entered the matching `recv` (NCCL's rule too). Dropping
    /// the group without `end` (an early `?`) closes it, then aborts this
    /// communicator (its peers expected the whole group).
    ///
    /// While an NCCL group is open, this thread's calls on other NCCL
    /// communicators (collectives, barriers, splits, another group) and
    /// the set-up of new ones (`init`, `local_group`) are refused: NCCL
    /// would hold them until this group's end, after they had returned (a
    /// set-up would wait out its timeout). Dropping another NCCL
    /// communicator inside the group is not guarded: end the group first.
    ///
    /// # Errors
    ///
    /// [`Error::Failed`] on a communicator that failed; [`Error::Nccl`];
    /// [`Error::InvalidArgument`] while another NCCL group is open on this
    /// thread.
    pub fn group(&mut self) -> Result<P2pGroup<'_>> {
        if let Some(first) = &self.failed {
            return Err(Error::Failed {
                op: OpKind::Send,
                rank: self.rank,
                first_error: first.clone(),
            });
        }
        self.refuse_inside_open_group(OpKind::Send)?;
        let kind = match &self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, .. } => {
                GroupKind::Nccl(GroupGuard::start(comm.library(), self.rank)?)
            }
            Engine::Ring(_) => GroupKind::Ring(Vec::new()),
        };
        Ok(P2pGroup {
            comm: self,
            kind: Some(kind),
            touch_after: Vec::new(),
            streams: Vec::new(),
            poisoned: None,
        })
    }

    /// Splits into sub-communicators (NCCL: `ncclCommSplit`; cuda-ring: the
    /// members meet in the group and form a new one): ranks passing the same
    /// `color` form one, ordered by `key` then by rank. Collective over this
    /// communicator; the new one uses the same GPU and a new stream.
    ///
    /// # Errors
    ///
    /// [`Error::LibraryUnsupported`] with NCCL older than 2.18, and with
    /// NCCL [`Error::InvalidArgument`] for a color above `i32::MAX` or a
    /// key outside `i32` (NCCL's `int`s); both leave this communicator
    /// usable. [`Error::DeviceTimeout`]; [`Error::Nccl`]; [`Error::Cuda`].
    pub fn split(&mut self, color: u32, key: i64) -> Result<DeviceCommunicator> {
        let rank = self.rank;
        self.split_or_none(Some(color), key)?
            .ok_or_else(|| Error::Cuda {
                rank,
                context: "split".into(),
                detail: "no communicator came back for a rank with a color".into(),
            })
    }

    /// [`split`](Self::split) where `None` leaves this rank out of every
    /// new communicator (`NCCL_SPLIT_NOCOLOR`).
    ///
    /// # Errors
    ///
    /// As [`split`](Self::split).
    pub fn split_or_none(&mut self, color: Option<u32>, key: i64) -> Result<Option<Self>> {
        let desc = self.desc::<u8>(OpKind::Split);
        self.admit(&desc, &[])?;
        self.refuse_inside_open_group(OpKind::Split)?;
        // A split NCCL refuses before it starts (no ncclCommSplit before
        // NCCL 2.18, a color or key outside its int) leaves this
        // communicator usable, like any rejected argument; only a split
        // that started and failed marks it failed below.
        #[cfg(feature = "nccl")]
        if let Engine::Nccl { comm, .. } = &self.engine {
            comm.check_split(color, key)?;
        }
        self.ctx
            .bind_to_thread()
            .map_err(cuda_error(self.rank, "binding the GPU to this thread"))?;
        self.seq += 1;
        let timeout = self.timeout;
        let settings = RingSettings {
            algo: self.ring_algo,
            chunk_bytes: self.chunk_bytes,
        };
        let child = match &mut self.engine {
            #[cfg(feature = "nccl")]
            Engine::Nccl { comm, .. } => comm.split(color, key).and_then(|c| {
                c.map(|c| Self::assemble(self.ctx.clone(), c, timeout))
                    .transpose()
            }),
            Engine::Ring(ring) => ring
                .split(color, key)
                .map(|c| c.map(|c| Self::assemble_ring(c, timeout, settings))),
        };
        if let Err(e) = &child {
            self.failed.get_or_insert_with(|| e.to_string());
        }
        child
    }

    fn out_of_place<T, S, R>(&mut self, desc: CollectiveDesc, send: &S, recv: &mut R) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let streams = [
            DeviceSlice::stream(send).clone(),
            DeviceSlice::stream(recv).clone(),
        ];
        self.admit(&desc, &streams)?;
        let stream = self.stream.clone();
        let (send_len, recv_len) = (Buffer::elem_count(send), Buffer::elem_count(recv));
        // Empty buffers (a non-root's send of broadcast, recv of reduce) are
        // passed as 0 and replaced by the other buffer, which NCCL then
        // does not dereference on that rank.
        let (send_ptr, _read) = send.device_ptr(&stream);
        let (recv_ptr, _write) = recv.device_ptr_mut(&stream);
        let send_ptr = if send_len == 0 { 0 } else { send_ptr };
        let recv_ptr = if recv_len == 0 { 0 } else { recv_ptr };
        self.enqueue(&desc, T::DTYPE.size(), (send_ptr, recv_ptr), &streams)
    }

    fn in_place<T, B>(&mut self, desc: CollectiveDesc, buf: &mut B) -> Result<()>
    where
        T: Element,
        B: DevicePtrMut<T> + Buffer<T>,
    {
        let streams = [DeviceSlice::stream(buf).clone()];
        self.admit(&desc, &streams)?;
        let stream = self.stream.clone();
        let (ptr, _write) = buf.device_ptr_mut(&stream);
        self.enqueue(&desc, T::DTYPE.size(), (ptr, ptr), &streams)
    }
}

/// The cuda-ring's pipeline piece: large, so a call is a few big copies
/// and kernels rather than many small ones (`OXCCL_CHUNK_BYTES` overrides).
/// Every piece of every ring step waits on a peer's event, and on the H200
/// each such wait cost ≈ 30 µs whatever the size: with 4 MiB pieces, a
/// 2-rank all-reduce of 64–256 MiB on one GPU reached 95–125 GB/s busbw,
/// with 16 MiB 387–420 GB/s, with 64 MiB 422–450 GB/s (same run, same
/// binary, `OXCCL_CHUNK_BYTES` set).
const RING_CHUNK_BYTES: usize = 64 << 20;

/// `OXCCL_CHUNK_BYTES` for the cuda-ring: a malformed value is an error,
/// as on the host backend, not a silent fall back to the default.
fn ring_chunk_bytes_from_env() -> Result<usize> {
    match crate::comm::env_value("OXCCL_CHUNK_BYTES")? {
        // As on the host backend: the default.
        Some(value) if value.eq_ignore_ascii_case("auto") => Ok(RING_CHUNK_BYTES),
        Some(value) => crate::comm::parse_byte_size(&value)
            .filter(|&b| b > 0)
            .ok_or_else(|| Error::Config {
                name: "OXCCL_CHUNK_BYTES".into(),
                value,
                reason: "expected auto or a positive number of bytes, such as 67108864 or 64M"
                    .into(),
            }),
        None => Ok(RING_CHUNK_BYTES),
    }
}

/// The cuda-ring's settings from the environment: `OXCCL_ALGO` and
/// `OXCCL_CHUNK_BYTES`, read once per communicator (splits inherit them).
fn ring_settings_from_env() -> Result<RingSettings> {
    Ok(RingSettings {
        algo: ring_algo_from_env()?,
        chunk_bytes: ring_chunk_bytes_from_env()?,
    })
}

/// See [`ring_settings_from_env`].
#[derive(Clone, Copy)]
struct RingSettings {
    algo: Algo,
    chunk_bytes: usize,
}

/// A validated call's plan on the cuda-ring: the host backend's ring
/// schedule, lowered to stream operations and run.
fn ring_plan(desc: &CollectiveDesc, chunk_bytes: usize) -> Lowered {
    let plan = schedule::plan_with(desc, chunk_bytes, Family::Ring);
    lower(&plan, desc.world_size)
}

/// A validated call's lowering on the cuda-ring: peer-direct when the
/// ranks can address each other's buffers and `algo` is not `Ring`, else
/// the ring's. Every rank decides alike (same call, same path table).
fn ring_lowering(
    ring: &RingComm,
    algo: Algo,
    desc: &CollectiveDesc,
    chunk_bytes: usize,
) -> Lowered {
    let direct = peer_direct_allowed(ring, algo)
        .then(|| lower_peer_direct(desc))
        .flatten();
    direct.unwrap_or_else(|| ring_plan(desc, chunk_bytes))
}

/// Whether the cuda-ring may run calls peer-direct: not forced onto the
/// ring, and the ranks can address each other's buffers.
fn peer_direct_allowed(ring: &RingComm, algo: Algo) -> bool {
    algo != Algo::Ring && ring.peer_direct_available()
}

/// `OXCCL_ALGO` for the cuda-ring: `ring` keeps every call on the ring;
/// `auto` (the default), `direct` and `tree` (the host's latency schedules,
/// which the cuda-ring does not lower) run all-reduce, reduce-scatter,
/// all-gather and broadcast peer-direct where the ranks allow it.
fn ring_algo_from_env() -> Result<Algo> {
    match crate::comm::env_value("OXCCL_ALGO")? {
        Some(value) => Algo::from_name(&value).ok_or_else(|| Error::Config {
            name: "OXCCL_ALGO".into(),
            value,
            reason: "expected auto, ring, direct or tree".into(),
        }),
        None => Ok(Algo::Auto),
    }
}

/// One NCCL call being enqueued.
#[cfg(feature = "nccl")]
struct NcclEnqueue<'a> {
    stream: &'a Arc<CudaStream>,
    seq: u64,
    elem_bytes: usize,
}

#[cfg(feature = "nccl")]
impl NcclEnqueue<'_> {
    fn run(
        &self,
        comm: &mut NcclComm,
        barrier_cell: &mut CudaSlice<f32>,
        desc: &CollectiveDesc,
        send: u64,
        recv: u64,
    ) -> Result<()> {
        let (stream, seq, elem_bytes) = (self.stream, self.seq, self.elem_bytes);
        let rank = comm.rank();
        let lib = comm.library();
        let raw = comm.raw();
        let cu_stream = stream.cu_stream() as sys::RawStream;
        let dtype = nccl::nccl_dtype(desc.dtype);
        let op = nccl::nccl_op(desc.reduce_op.unwrap_or(ReduceOp::Sum));
        let at = |base: u64, elems: usize| (base + (elems * elem_bytes) as u64) as *mut _;
        let detail = format!("{} #{seq} on rank {rank}", desc.op);
        let (call, rc) = match NcclCall::plan(desc) {
            // SAFETY (every arm): the addresses come from live device buffers
            // whose lengths `validate()` checked against the counts passed;
            // `comm` and `stream` are live and belong to this GPU.
            NcclCall::AllReduce { count } => ("ncclAllReduce", unsafe {
                (lib.all_reduce)(at(send, 0), at(recv, 0), count, dtype, op, raw, cu_stream)
            }),
            NcclCall::ReduceScatter {
                recv_count,
                recv_offset,
            } => ("ncclReduceScatter", unsafe {
                (lib.reduce_scatter)(
                    at(send, 0),
                    at(recv, recv_offset),
                    recv_count,
                    dtype,
                    op,
                    raw,
                    cu_stream,
                )
            }),
            NcclCall::AllGather {
                send_count,
                send_offset,
            } => ("ncclAllGather", unsafe {
                (lib.all_gather)(
                    at(send, send_offset),
                    at(recv, 0),
                    send_count,
                    dtype,
                    raw,
                    cu_stream,
                )
            }),
            NcclCall::Broadcast { count, root } => ("ncclBroadcast", unsafe {
                (lib.broadcast)(
                    at(if send == 0 { recv } else { send }, 0),
                    at(recv, 0),
                    count,
                    dtype,
                    root as i32,
                    raw,
                    cu_stream,
                )
            }),
            NcclCall::Reduce { count, root } => ("ncclReduce", unsafe {
                (lib.reduce)(
                    at(send, 0),
                    at(if recv == 0 { send } else { recv }, 0),
                    count,
                    dtype,
                    op,
                    root as i32,
                    raw,
                    cu_stream,
                )
            }),
            NcclCall::Send { count, peer } => ("ncclSend", unsafe {
                (lib.send)(at(send, 0), count, dtype, peer as i32, raw, cu_stream)
            }),
            NcclCall::Recv { count, peer } => ("ncclRecv", unsafe {
                (lib.recv)(at(recv, 0), count, dtype, peer as i32, raw, cu_stream)
            }),
            NcclCall::AllToAll { block } => {
                let group = GroupGuard::start(lib, rank)?;
                let enqueue = |comm: &mut NcclComm| -> Result<()> {
                    for peer in 0..comm.world() {
                        // SAFETY: as above; block `peer` of each buffer is in bounds.
                        let rc = unsafe {
                            (lib.send)(
                                at(send, peer * block),
                                block,
                                dtype,
                                peer as i32,
                                raw,
                                cu_stream,
                            )
                        };
                        comm.finish_call("ncclSend", rc, &detail)?;
                        // SAFETY: as above.
                        let rc = unsafe {
                            (lib.recv)(
                                at(recv, peer * block),
                                block,
                                dtype,
                                peer as i32,
                                raw,
                                cu_stream,
                            )
                        };
                        comm.finish_call("ncclRecv", rc, &detail)?;
                    }
                    Ok(())
                };
                if let Err(e) = enqueue(comm) {
                    // Whatever of the group was queued, unmatched by the
                    // calls that failed, would leave the peers' halves
                    // waiting on the device for good: the group is closed
                    // and the communicator aborted (stopping anything the
                    // close launched), as for a p2p group that fails.
                    drop(group);
                    comm.abort();
                    return Err(e);
                }
                ("ncclGroupEnd", group.end())
            }
            NcclCall::Barrier => {
                let (cell, _record) = barrier_cell.device_ptr_mut(stream);
                let rc = unsafe {
                    (lib.all_reduce)(
                        at(cell, 0),
                        at(cell, 0),
                        1,
                        nccl::nccl_dtype(crate::types::DType::F32),
                        nccl::nccl_op(ReduceOp::Sum),
                        raw,
                        cu_stream,
                    )
                };
                ("ncclAllReduce", rc)
            }
        };
        comm.finish_call(call, rc, &detail)
    }
}

/// Rejects a call whose buffers are on another GPU than the communicator's.
fn check_same_device(desc: &CollectiveDesc, own: usize, ordinals: &[usize]) -> Result<()> {
    match ordinals.iter().find(|&&o| o != own) {
        Some(other) => Err(Error::InvalidArgument {
            op: desc.op,
            rank: desc.rank,
            arg: "buffer",
            reason: format!("the buffer is on GPU {other}, the communicator works on GPU {own}"),
        }),
        None => Ok(()),
    }
}

/// How a group collects its calls.
enum GroupKind {
    /// NCCL's thread-local group, open.
    #[cfg(feature = "nccl")]
    Nccl(GroupGuard),
    /// The cuda-ring runs the group as one call at `end`: its parts here
    /// (sends first, then receives, in the order given).
    Ring(Vec<RingPart>),
}

/// One point-to-point call of a cuda-ring group.
struct RingPart {
    desc: CollectiveDesc,
    ptr: u64,
}

/// Re-records one buffer's use on a stream (see [`P2pGroup`]).
type Touch<'a> = Box<dyn FnOnce(&CudaStream) + 'a>;

/// An open `ncclGroupStart` … `ncclGroupEnd` of point-to-point calls on one
/// communicator, from [`DeviceCommunicator::group`]. Buffers must outlive the
/// group (`'a`); NCCL launches everything at [`end`](Self::end).
///
/// A group cannot be half-run: when a call is rejected inside it, or the
/// group is dropped without `end` (an early `?`), NCCL's group is still
/// closed, and the communicator is aborted and marked failed — the peers
/// expect the whole group, so the communicator cannot be trusted after.
pub struct P2pGroup<'a> {
    comm: &'a mut DeviceCommunicator,
    /// `None` once closed.
    kind: Option<GroupKind>,
    /// Re-records each buffer's use on the stream after the group is
    /// launched, so cudarc's tracking orders later frees and writes after
    /// the transfer rather than after the (empty) enqueue.
    touch_after: Vec<Touch<'a>>,
    /// The buffers' own streams, ordered after the group once it launches.
    streams: Vec<Arc<CudaStream>>,
    /// Set when a call inside the group was rejected.
    poisoned: Option<String>,
}

impl<'a> P2pGroup<'a> {
    /// Adds `ncclSend(buf, peer)`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a bad peer or a buffer on another GPU
    /// (the group is then poisoned: see the type's docs).
    pub fn send<T, S>(&mut self, buf: &'a S, peer: Rank) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T> + Buffer<T>,
    {
        let desc = self
            .comm
            .desc::<T>(OpKind::Send)
            .with_send(BufDesc::of(buf))
            .with_peer(peer);
        self.admit(&desc, DeviceSlice::stream(buf))?;
        let stream = self.comm.stream.clone();
        let (ptr, read) = buf.device_ptr(&stream);
        drop(read);
        self.touch_after.push(Box::new(move |s| {
            let _ = buf.device_ptr(s);
        }));
        if let Some(GroupKind::Ring(parts)) = &mut self.kind {
            parts.push(RingPart { desc, ptr });
            return Ok(());
        }
        let ptr = ptr as *const std::ffi::c_void;
        #[cfg(feature = "nccl")]
        let result = self.raw_p2p(&desc, |lib, comm, stream, dtype| {
            // SAFETY: a live buffer of `desc`'s validated length.
            unsafe {
                (lib.send)(
                    ptr,
                    desc.send.map_or(0, |b| b.len),
                    dtype,
                    peer as i32,
                    comm,
                    stream,
                )
            }
        });
        #[cfg(not(feature = "nccl"))]
        let result = {
            let _ = ptr;
            Ok(())
        };
        result
    }

    /// Adds `ncclRecv(buf, peer)`.
    ///
    /// # Errors
    ///
    /// As [`send`](Self::send).
    pub fn recv<T, R>(&mut self, buf: &'a mut R, peer: Rank) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T> + Buffer<T>,
    {
        let desc = self
            .comm
            .desc::<T>(OpKind::Recv)
            .with_recv(BufDesc::of(buf))
            .with_peer(peer);
        self.admit(&desc, DeviceSlice::stream(buf))?;
        let stream = self.comm.stream.clone();
        let (ptr, write) = buf.device_ptr_mut(&stream);
        drop(write);
        self.touch_after.push(Box::new(move |s| {
            let _ = buf.device_ptr_mut(s);
        }));
        if let Some(GroupKind::Ring(parts)) = &mut self.kind {
            parts.push(RingPart { desc, ptr });
            return Ok(());
        }
        let ptr = ptr as *mut std::ffi::c_void;
        #[cfg(feature = "nccl")]
        let result = self.raw_p2p(&desc, |lib, comm, stream, dtype| {
            // SAFETY: a live buffer of `desc`'s validated length.
            unsafe {
                (lib.recv)(
                    ptr,
                    desc.recv.map_or(0, |b| b.len),
                    dtype,
                    peer as i32,
                    comm,
                    stream,
                )
            }
        });
        #[cfg(not(feature = "nccl"))]
        let result = {
            let _ = ptr;
            Ok(())
        };
        result
    }

    /// The communicator's check, poisoning the group when it fails, and the
    /// ordering of our stream after the buffer's.
    fn admit(&mut self, desc: &CollectiveDesc, buffer_stream: &Arc<CudaStream>) -> Result<()> {
        let streams = [buffer_stream.clone()];
        let admitted = self
            .comm
            .admit(desc, &streams)
            .and_then(|()| self.comm.wait_for_buffers(&streams));
        match admitted {
            Ok(()) => {
                self.streams.push(buffer_stream.clone());
                Ok(())
            }
            Err(e) => {
                self.poisoned.get_or_insert_with(|| e.to_string());
                Err(e)
            }
        }
    }

    #[cfg(feature = "nccl")]
    fn raw_p2p(
        &mut self,
        desc: &CollectiveDesc,
        call: impl FnOnce(
            &sys::NcclLibrary,
            sys::RawComm,
            sys::RawStream,
            sys::NcclDataType,
        ) -> sys::NcclResult,
    ) -> Result<()> {
        let comm = &mut *self.comm;
        let Engine::Nccl { comm: nccl, .. } = &mut comm.engine else {
            return Ok(());
        };
        let rc = call(
            nccl.library(),
            nccl.raw(),
            comm.stream.cu_stream() as sys::RawStream,
            nccl::nccl_dtype(desc.dtype),
        );
        let name = if desc.op == OpKind::Send {
            "ncclSend"
        } else {
            "ncclRecv"
        };
        let detail = format!("{} in a group on rank {}", desc.op, comm.rank);
        let result = nccl.finish_call(name, rc, &detail);
        if let Err(e) = &result {
            comm.failed.get_or_insert_with(|| e.to_string());
        }
        result
    }

    /// Closes the group (NCCL: `ncclGroupEnd`, launching what it holds;
    /// cuda-ring: one call with every part, sends first) and orders every
    /// buffer after it; returns the group's result.
    fn close(&mut self) -> Result<()> {
        let Some(kind) = self.kind.take() else {
            return Ok(());
        };
        let comm = &mut *self.comm;
        comm.seq += 1;
        let launched = match (kind, &mut comm.engine) {
            #[cfg(feature = "nccl")]
            (GroupKind::Nccl(guard), Engine::Nccl { comm: nccl, .. }) => {
                let detail = format!("point-to-point group on rank {}", comm.rank);
                nccl.finish_call("ncclGroupEnd", guard.end(), &detail)
            }
            (GroupKind::Ring(mut parts), Engine::Ring(ring)) if self.poisoned.is_none() => {
                // Sends first: they only need the receivers' ready inboxes,
                // which every rank publishes at the start of its call.
                parts.sort_by_key(|p| p.desc.op != OpKind::Send);
                let lowered: Vec<Lowered> = parts
                    .iter()
                    .map(|p| ring_plan(&p.desc, comm.chunk_bytes))
                    .collect();
                let bufs: Vec<CallBufs> = parts
                    .iter()
                    .map(|p| match p.desc.op {
                        OpKind::Send => CallBufs {
                            send: p.ptr,
                            recv: 0,
                        },
                        _ => CallBufs {
                            send: 0,
                            recv: p.ptr,
                        },
                    })
                    .collect();
                if lowered.is_empty() {
                    Ok(())
                } else {
                    let dtype = parts[0].desc.dtype;
                    if parts.iter().any(|p| p.desc.dtype.size() != dtype.size()) {
                        // Offsets are in elements of one size per call.
                        Err(Error::InvalidArgument {
                            op: OpKind::Send,
                            rank: comm.rank,
                            arg: "buffer",
                            reason: "a cuda-ring group mixes element sizes; use one group per \
                                     element type"
                                .into(),
                        })
                    } else {
                        ring.run(OpKind::Send, dtype, ReduceOp::Sum, &concat(&lowered), &bufs)
                    }
                }
            }
            _ => Ok(()),
        };
        let stream = comm.stream.clone();
        for touch in self.touch_after.drain(..) {
            touch(&stream);
        }
        let ordered = comm.release_buffers(&self.streams);
        launched.and(ordered)
    }

    /// `ncclGroupEnd`: launches every call of the group on the stream.
    ///
    /// # Errors
    ///
    /// [`Error::Nccl`]; [`Error::DeviceTimeout`] when NCCL's launch does not
    /// finish in time; [`Error::Failed`] when a call inside the group was
    /// rejected (the communicator is then aborted).
    pub fn end(mut self) -> Result<()> {
        let result = self.close();
        let result = match (result, self.poisoned.take()) {
            (Err(e), _) => Err(e),
            (Ok(()), None) => Ok(()),
            (Ok(()), Some(first)) => Err(Error::Failed {
                op: OpKind::Send,
                rank: self.comm.rank,
                first_error: format!("a call inside the group was rejected: {first}"),
            }),
        };
        if let Err(e) = &result {
            self.comm.abort();
            self.comm.failed = Some(e.to_string());
        }
        result
    }
}

impl Drop for P2pGroup<'_> {
    /// A group dropped without [`end`](P2pGroup::end): close it (NCCL's
    /// group state is per thread and must not stay open), keep the buffers
    /// ordered after whatever it launched, then abort the communicator — the
    /// peers' matching calls can no longer be trusted to pair up.
    fn drop(&mut self) {
        match self.kind {
            None => return,
            // Nothing of a cuda-ring group ran yet: drop its parts.
            Some(GroupKind::Ring(_)) => self.kind = None,
            #[cfg(feature = "nccl")]
            Some(GroupKind::Nccl(_)) => {
                let _ = self.close();
            }
        }
        self.comm.abort();
        self.comm.failed = Some("a point-to-point group was dropped without end()".into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::DType;

    fn dev(len: usize) -> BufDesc {
        BufDesc {
            len,
            memory: MemoryKind::Device,
        }
    }

    #[test]
    fn backends_parse_and_the_cuda_ring_fails_cleanly_without_a_driver() {
        assert_eq!(
            DeviceBackend::from_name("cuda-ring"),
            Some(DeviceBackend::CudaRing)
        );
        assert_eq!(
            DeviceBackend::from_name(" NCCL "),
            Some(DeviceBackend::Nccl)
        );
        assert_eq!(DeviceBackend::from_name("auto"), Some(DeviceBackend::Auto));
        assert_eq!(DeviceBackend::from_name("gloo"), None);
        for b in [
            DeviceBackend::Auto,
            DeviceBackend::Nccl,
            DeviceBackend::CudaRing,
        ] {
            assert_eq!(DeviceBackend::from_name(b.name()), Some(b));
        }
        // With `auto`, ranks other than 0 follow rank 0's published choice,
        // and say so when it never comes.
        let store = std::sync::Arc::new(crate::bootstrap::MemoryStore::new());
        let e = DeviceCommunicator::builder()
            .backend(DeviceBackend::Auto)
            .timeout(Duration::from_millis(50))
            .init(1, 2, store)
            .unwrap_err();
        assert!(matches!(e, Error::RendezvousTimeout { .. }), "{e:?}");
        // SAFETY: only tries to dlopen the driver.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            // Ranks in separate processes on the cuda-ring: the driver is
            // looked for before any rendezvous.
            let ring = DeviceCommunicator::builder().backend(DeviceBackend::CudaRing);
            let store = std::sync::Arc::new(crate::bootstrap::MemoryStore::new());
            let errors = [
                ring.init(0, 2, store).unwrap_err(),
                ring.local_group(3).unwrap_err(),
            ];
            for e in errors {
                assert!(
                    matches!(
                        e,
                        Error::LibraryNotFound {
                            library: "CUDA driver",
                            ..
                        }
                    ),
                    "{e:?}"
                );
            }
        }
    }

    /// The checks a device call makes before enqueueing anything: these run
    /// on machines with no GPU, since they never reach the driver or NCCL.
    #[test]
    fn bad_device_calls_are_rejected_before_anything_is_enqueued() {
        let base = |op| CollectiveDesc::new(op, DType::F32, 1, 4, MemoryKind::Device);
        let bad_lengths = base(OpKind::AllReduce)
            .with_send(dev(8))
            .with_recv(dev(7))
            .with_reduce_op(ReduceOp::Sum);
        let e = bad_lengths.validate().unwrap_err().to_string();
        assert!(e.contains("all_reduce"), "{e}");
        let bad_gather = base(OpKind::AllGather).with_send(dev(3)).with_recv(dev(11));
        assert!(bad_gather.validate().is_err());
        let bad_root = base(OpKind::Broadcast)
            .with_send(dev(3))
            .with_recv(dev(3))
            .with_root(4);
        assert!(bad_root
            .validate()
            .unwrap_err()
            .to_string()
            .contains("root"));
        let self_send = base(OpKind::Send).with_send(dev(3)).with_peer(1);
        assert!(self_send.validate().is_err());
        let host_buffer = base(OpKind::AllReduce)
            .with_send(BufDesc {
                len: 8,
                memory: MemoryKind::Host,
            })
            .with_recv(dev(8))
            .with_reduce_op(ReduceOp::Sum);
        assert!(host_buffer
            .validate()
            .unwrap_err()
            .to_string()
            .contains("Host"));
        let good = base(OpKind::AllReduce)
            .with_send(dev(8))
            .with_recv(dev(8))
            .with_reduce_op(ReduceOp::Sum);
        good.validate().unwrap();
        let e = check_same_device(&good, 0, &[0, 1])
            .unwrap_err()
            .to_string();
        assert!(e.contains("GPU 1") && e.contains("GPU 0"), "{e}");
        check_same_device(&good, 1, &[1, 1]).unwrap();
    }
}
