//! What the launcher told this process: its rank, the job's size, where the
//! rendezvous store is.

use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::types::Rank;

/// torch's default `MASTER_PORT`.
const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher's variables gave the rank and world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchSource {
    /// `RANK` and `WORLD_SIZE`: torchrun, `oxccl-run`, or set by hand.
    Torchrun,
    /// `OMPI_COMM_WORLD_*`: Open MPI's `mpirun`.
    OpenMpi,
    /// `PMI_RANK` and `PMI_SIZE`: the Hydra `mpiexec` of MPICH and Intel
    /// MPI (and Slurm's PMI-2 plugin).
    Pmi,
    /// `SLURM_PROCID` and `SLURM_STEP_NUM_TASKS`: Slurm's `srun`.
    Slurm,
}

/// The launch environment of this rank, read from the variables that
/// launchers set.
///
/// # Sources
///
/// | launcher | rank, world size | local rank, local size |
/// |---|---|---|
/// | torchrun, `oxccl-run` | `RANK`, `WORLD_SIZE` | `LOCAL_RANK`, `LOCAL_WORLD_SIZE` |
/// | Open MPI | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE` |
/// | MPICH, Intel MPI (Hydra `mpiexec`), Cray PALS | `PMI_RANK`, `PMI_SIZE` | `MPI_LOCALRANKID`, `MPI_LOCALNRANKS` (PALS: `PMI_LOCAL_RANK`, `PMI_LOCAL_SIZE`); required |
/// | Slurm (`srun`) | `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS` | `SLURM_LOCALID`, see below |
///
/// When several are present, torchrun's win over Open MPI's, which win over
/// PMI's, which win over Slurm's. If `RANK`/`WORLD_SIZE` disagree with the
/// next launcher's variables, that is an error (usually a stale `export
/// RANK=...`), except when torchrun or `oxccl-run` started this process
/// (`TORCHELASTIC_RUN_ID` or `OXCCL_JOB_ID` is set): then the outer
/// launcher started the launcher, not this rank, and its variables describe
/// the launcher. Slurm's variables are ignored under Open MPI and PMI:
/// `mpirun` inside an allocation sees the batch script's `SLURM_PROCID`,
/// and Hydra starts its per-node proxies with `srun`, so its ranks see the
/// proxy step's `SLURM_PROCID` and `SLURM_STEP_NUM_TASKS` (a node's index
/// and the number of nodes), not their own. Where PMI's pair equals
/// Slurm's (Slurm's PMI-2 plugin), Slurm's variables are read instead.
///
/// Slurm counts only inside a job step that `srun` started, marked by
/// `SLURM_STEP_NUM_TASKS`, which only `srun` sets: a batch script has
/// `SLURM_PROCID=0`, `SLURM_LOCALID=0` and the allocation's `SLURM_NTASKS`
/// too, but it is one process, not task 0 of them (a program run straight
/// from it would wait for ranks that never start, and a launcher run from it
/// would have its ranks' `RANK` read as disagreeing with `SLURM_PROCID=0`).
///
/// A missing local rank defaults to `rank % local_size` when the local size
/// is known, else to `rank`; a missing local size defaults to the world size
/// (every rank on one node). Under Slurm the local size is this node's entry
/// (`SLURM_NODEID`) of `SLURM_STEP_TASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`
/// (`4`, `4(x2)`, `2,1`), else `SLURM_NTASKS_PER_NODE`, else the world size
/// when `SLURM_NNODES` is 1.
///
/// # The store's address
///
/// `MASTER_ADDR` defaults to `127.0.0.1` when every rank is on this node, and
/// under Slurm to the first host of `SLURM_STEP_NODELIST` (or
/// `SLURM_JOB_NODELIST`), where task 0 runs. `MASTER_PORT` defaults to 29500.
/// When `TORCHELASTIC_USE_AGENT_STORE` is `True`, torchrun's own store
/// already listens on `MASTER_PORT`, so oxccl's store uses `MASTER_PORT + 1`
/// (and [`master_port`](LaunchEnv::master_port) holds that port).
///
/// Empty variables count as unset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank in the job.
    pub rank: Rank,
    /// The number of ranks in the job.
    pub world_size: usize,
    /// This process's rank among the ranks on its node.
    pub local_rank: usize,
    /// The number of ranks on this node.
    pub local_world_size: usize,
    /// The host of the rendezvous store (rank 0's node).
    pub master_addr: String,
    /// The port of the rendezvous store.
    pub master_port: u16,
    /// Which launcher's variables gave the rank and world size.
    pub source: LaunchSource,
    /// `OXCCL_STORE=file:/dir` selects a [`FileStore`](super::FileStore) in
    /// that directory instead of the TCP store.
    pub file_store: Option<PathBuf>,
    /// `OXCCL_JOB_ID` (set by `oxccl-run`), used to name shared-memory
    /// segments.
    pub job_id: Option<String>,
}

/// The variable names of one launcher.
struct Names {
    source: LaunchSource,
    rank: &'static str,
    size: &'static str,
    local_rank: &'static str,
    local_size: &'static str,
}

const TORCH: Names = Names {
    source: LaunchSource::Torchrun,
    rank: "RANK",
    size: "WORLD_SIZE",
    local_rank: "LOCAL_RANK",
    local_size: "LOCAL_WORLD_SIZE",
};
const OMPI: Names = Names {
    source: LaunchSource::OpenMpi,
    rank: "OMPI_COMM_WORLD_RANK",
    size: "OMPI_COMM_WORLD_SIZE",
    local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
    local_size: "OMPI_COMM_WORLD_LOCAL_SIZE",
};
const PMI: Names = Names {
    source: LaunchSource::Pmi,
    rank: "PMI_RANK",
    size: "PMI_SIZE",
    local_rank: "MPI_LOCALRANKID",
    local_size: "MPI_LOCALNRANKS",
};
/// PMI with the local pair Cray's PALS sets instead of Hydra's.
const PMI_PALS: Names = Names {
    local_rank: "PMI_LOCAL_RANK",
    local_size: "PMI_LOCAL_SIZE",
    ..PMI
};
const SLURM: Names = Names {
    source: LaunchSource::Slurm,
    rank: "SLURM_PROCID",
    size: "SLURM_STEP_NUM_TASKS",
    local_rank: "SLURM_LOCALID",
    local_size: "SLURM_TASKS_PER_NODE",
};

/// A launcher's rank and world size, as found.
struct Found {
    names: &'static Names,
    rank: usize,
    size: usize,
}

fn config(name: &str, value: &str, reason: impl Into<String>) -> Error {
    Error::Config {
        name: name.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

impl LaunchEnv {
    /// Reads the launch environment of this process. See [`LaunchEnv`] for
    /// the variables.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the variable when one is malformed or out of
    /// range, when two launchers' variables disagree, or when no launcher's
    /// variables are present.
    pub fn from_env() -> Result<LaunchEnv> {
        LaunchEnv::from_vars(|name| {
            std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
        })
    }

    /// Whether a launcher started this process as one rank of a job: its
    /// rank variable is set (`RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, or
    /// `SLURM_PROCID` inside an `srun` step, as [`from_env`](LaunchEnv::from_env)
    /// reads them). Looks at nothing else, so it holds where the other
    /// variables are malformed.
    pub fn launcher_present() -> bool {
        let set = |name: &str| std::env::var_os(name).is_some_and(|v| !v.is_empty());
        set(TORCH.rank) || set(OMPI.rank) || set(PMI.rank) || (set(SLURM.rank) && set(SLURM.size))
    }

    /// As [`from_env`](LaunchEnv::from_env), reading variables through `get`.
    ///
    /// # Errors
    ///
    /// As [`from_env`](LaunchEnv::from_env).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let var = |name: &str| {
            get(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };

        let torch = find(&var, &TORCH, true)?;
        let ompi = find(&var, &OMPI, true)?;
        let pmi = find(&var, &PMI, true)?;
        let slurm = find(&var, &SLURM, false)?;
        // Slurm's own PMI-2 plugin sets PMI_RANK and PMI_SIZE equal to its
        // task's: then Slurm's variables, which also say how many tasks
        // share the node, describe the ranks. Only where the two disagree
        // (Hydra's proxies under srun) are Slurm's ignored.
        let pmi = pmi.filter(|p| {
            !slurm
                .as_ref()
                .is_some_and(|s| s.rank == p.rank && s.size == p.size)
        });
        // Hydra's local pair, else Cray PALS's.
        let has_pair =
            |names: &Names| var(names.local_rank).is_some() || var(names.local_size).is_some();
        let pmi = pmi.map(|found| {
            if !has_pair(&PMI) && has_pair(&PMI_PALS) {
                Found {
                    names: &PMI_PALS,
                    ..found
                }
            } else {
                found
            }
        });
        // The first launcher below torchrun's that is present: Slurm's
        // count only when neither MPI launcher's are (see above).
        let launcher = ompi.or(pmi).or(slurm);

        let nested = var("TORCHELASTIC_RUN_ID").is_some() || var("OXCCL_JOB_ID").is_some();
        if let (Some(t), false) = (&torch, nested) {
            // Under an MPI launcher, Slurm's variables describe the batch
            // script or a proxy (a wrapper exporting
            // RANK=$OMPI_COMM_WORLD_RANK inside an allocation still sees
            // SLURM_PROCID of the node's first task).
            if let Some(other) = launcher.as_ref() {
                check_agree(t, other)?;
            }
        }

        let Some(found) = torch.or(launcher) else {
            return Err(config(
                "RANK",
                "",
                "no launcher variables found: set RANK and WORLD_SIZE (torchrun/oxccl-run), or \
                 run under mpirun (OMPI_COMM_WORLD_*), MPICH's or Intel MPI's mpiexec \
                 (PMI_RANK/PMI_SIZE) or srun (SLURM_PROCID/SLURM_STEP_NUM_TASKS); or build the \
                 communicator explicitly with CommBuilder",
            ));
        };
        let names = found.names;
        let (rank, world_size) = (found.rank, found.size);
        // PMI without a local pair (Flux, a PMI-2 server outside Slurm)
        // cannot tell which ranks share this node: an error naming them,
        // not a guess that every rank is local.
        if names.source == LaunchSource::Pmi && !has_pair(names) {
            return Err(config(
                PMI.local_rank,
                "",
                format!(
                    "PMI_RANK={rank} and PMI_SIZE={world_size} are set, but not the ranks on \
                     this node (MPI_LOCALRANKID/MPI_LOCALNRANKS, or PMI_LOCAL_RANK/\
                     PMI_LOCAL_SIZE): set LOCAL_RANK and LOCAL_WORLD_SIZE with RANK and \
                     WORLD_SIZE"
                ),
            ));
        }
        if world_size == 0 {
            return Err(config(names.size, "0", "the world size must be at least 1"));
        }
        if world_size > super::MAX_WORLD_SIZE {
            return Err(config(
                names.size,
                &world_size.to_string(),
                format!("the world size must be at most {}", super::MAX_WORLD_SIZE),
            ));
        }
        if rank >= world_size {
            return Err(config(
                names.rank,
                &rank.to_string(),
                format!("the rank must be less than {}={world_size}", names.size),
            ));
        }

        let (local_size_name, local_size) = match names.source {
            LaunchSource::Slurm => slurm_local_size(&var, world_size)?,
            _ => (
                names.local_size,
                var(names.local_size)
                    .map(|v| parse_count(names.local_size, &v))
                    .transpose()?,
            ),
        };
        let local_rank = var(names.local_rank)
            .map(|v| parse_count(names.local_rank, &v))
            .transpose()?;
        let (local_rank, local_world_size) = match (local_rank, local_size) {
            (Some(r), Some(s)) => (r, s),
            (None, Some(s)) => (if s == 0 { 0 } else { rank % s }, s),
            (Some(r), None) => (r, world_size),
            (None, None) => (rank, world_size),
        };
        if local_world_size == 0 {
            return Err(config(
                local_size_name,
                "0",
                "the local size must be at least 1",
            ));
        }
        if local_world_size > world_size {
            return Err(config(
                local_size_name,
                &local_world_size.to_string(),
                format!(
                    "more ranks on this node than in the job ({}={world_size})",
                    names.size
                ),
            ));
        }
        if local_rank >= local_world_size {
            return Err(config(
                names.local_rank,
                &local_rank.to_string(),
                format!("the local rank must be less than {local_size_name}={local_world_size}"),
            ));
        }

        let master_addr = match var("MASTER_ADDR") {
            Some(addr) => host_only(addr)?,
            None if local_world_size == world_size => "127.0.0.1".into(),
            None if names.source == LaunchSource::Slurm => slurm_master(&var)?,
            None => {
                return Err(config(
                    "MASTER_ADDR",
                    "",
                    format!(
                        "required when ranks span several nodes ({local_size_name}=\
                         {local_world_size} < {}={world_size}): set it to the host name or \
                         address of rank 0's node",
                        names.size
                    ),
                ))
            }
        };

        let mut master_port = match var("MASTER_PORT") {
            None => DEFAULT_MASTER_PORT,
            Some(v) => v.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| {
                config("MASTER_PORT", &v, "expected a port number from 1 to 65535")
            })?,
        };
        let agent_store = var("TORCHELASTIC_USE_AGENT_STORE")
            .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
        if agent_store {
            master_port = master_port.checked_add(1).ok_or_else(|| {
                config(
                    "MASTER_PORT",
                    &master_port.to_string(),
                    "torchrun's agent store holds this port and oxccl's store uses the next \
                     one, but there is none above 65535: choose a lower MASTER_PORT",
                )
            })?;
        }

        let file_store = match var("OXCCL_STORE") {
            None => None,
            Some(v) => match v.strip_prefix("file:") {
                Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
                _ => {
                    return Err(config(
                        "OXCCL_STORE",
                        &v,
                        "expected file:/shared/dir (a directory every rank can see); unset it \
                         to use the TCP store at MASTER_ADDR:MASTER_PORT",
                    ))
                }
            },
        };

        Ok(LaunchEnv {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            source: names.source,
            file_store,
            job_id: var("OXCCL_JOB_ID"),
        })
    }
}

impl LaunchEnv {
    /// `MASTER_ADDR:MASTER_PORT` as a socket address string: an IPv6
    /// literal (`fd00::1`) gets the brackets that keep its colons apart from
    /// the port's (`[fd00::1]:29500`); a name, an IPv4 address or an
    /// address already in brackets is used as written.
    pub fn store_address(&self) -> String {
        // A link-local address may carry its zone (`fe80::1%eth0`).
        let address = self.master_addr.split('%').next().unwrap_or_default();
        if address.parse::<std::net::Ipv6Addr>().is_ok() {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }
}

/// `MASTER_ADDR` as given, when it is a host name or address alone: one
/// with a port (`10.0.0.1:29500`, `[::1]:29500`), a scheme (`tcp://h`) or a
/// path was taken for a name that never resolves, and every rank waited
/// out its whole timeout.
fn host_only(addr: String) -> Result<String> {
    // Brackets off first, then the zone (`[fe80::1%eth0]`).
    let unbracketed = addr.strip_prefix('[').and_then(|b| b.strip_suffix(']'));
    let bracketed = unbracketed.is_some();
    let inner = unbracketed.unwrap_or(&addr);
    let inner = inner.split('%').next().unwrap_or_default();
    let ipv6 = inner.parse::<std::net::Ipv6Addr>().is_ok();
    let reason = if addr.contains("://") || addr.contains('/') {
        Some("expected a host name or address, without a scheme or path")
    } else if addr.chars().any(char::is_whitespace) {
        Some("expected a host name or address, without spaces")
    } else if (bracketed || addr.contains(':')) && !ipv6 {
        Some("expected a host name or address without a port: the port goes in MASTER_PORT")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(config("MASTER_ADDR", &addr, reason)),
        None => Ok(addr),
    }
}

fn parse_count(name: &str, value: &str) -> Result<usize> {
    value
        .parse()
        .map_err(|_| config(name, value, "expected a non-negative integer"))
}

/// One launcher's rank and world size. A lone half is an error when
/// `strict`, and means "absent" otherwise (a Slurm batch script outside
/// `srun` has `SLURM_PROCID` but no `SLURM_STEP_NUM_TASKS`).
fn find(
    var: &impl Fn(&str) -> Option<String>,
    names: &'static Names,
    strict: bool,
) -> Result<Option<Found>> {
    match (var(names.rank), var(names.size)) {
        (Some(rank), Some(size)) => Ok(Some(Found {
            names,
            rank: parse_count(names.rank, &rank)?,
            size: parse_count(names.size, &size)?,
        })),
        (Some(rank), None) if strict => Err(config(
            names.rank,
            &rank,
            format!(
                "{} is set but {} is not: set both, or neither",
                names.rank, names.size
            ),
        )),
        (None, Some(size)) if strict => Err(config(
            names.size,
            &size,
            format!(
                "{} is set but {} is not: set both, or neither",
                names.size, names.rank
            ),
        )),
        _ => Ok(None),
    }
}

fn check_agree(a: &Found, b: &Found) -> Result<()> {
    let disagree = |an: &str, av: usize, bn: &str, bv: usize| {
        config(
            an,
            &av.to_string(),
            format!("{an}={av} but {bn}={bv}: two launchers' variables disagree; unset one"),
        )
    };
    if a.rank != b.rank {
        return Err(disagree(a.names.rank, a.rank, b.names.rank, b.rank));
    }
    if a.size != b.size {
        return Err(disagree(a.names.size, a.size, b.names.size, b.size));
    }
    Ok(())
}

/// Slurm's ranks on this node: the variable it came from and its value.
fn slurm_local_size(
    var: &impl Fn(&str) -> Option<String>,
    world_size: usize,
) -> Result<(&'static str, Option<usize>)> {
    let node = var("SLURM_NODEID").and_then(|v| v.parse::<usize>().ok());
    for name in ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"] {
        if let Some(v) = var(name) {
            let counts = parse_tasks_per_node(&v)
                .ok_or_else(|| config(name, &v, "expected a list such as 4, 4(x2) or 2(x3),1"))?;
            // One count for every node needs no node index; a list that
            // differs by node does, and guessing its first entry would
            // place ranks on the wrong node.
            let uniform = counts.windows(2).all(|w| w[0].0 == w[1].0);
            let here = match node.and_then(|n| nth_count(&counts, n)) {
                Some(count) => Some(count),
                None if uniform => counts.first().map(|&(c, _)| c),
                None => {
                    let raw = var("SLURM_NODEID").unwrap_or_default();
                    return Err(config(
                        "SLURM_NODEID",
                        &raw,
                        format!(
                            "{name}={v} gives different task counts per node, and SLURM_NODEID \
                             does not name one of its nodes: cannot tell how many ranks share \
                             this node; set LOCAL_RANK and LOCAL_WORLD_SIZE"
                        ),
                    ));
                }
            };
            return Ok((name, here));
        }
    }
    if let Some(v) = var("SLURM_NTASKS_PER_NODE") {
        let counts = parse_tasks_per_node(&v)
            .ok_or_else(|| config("SLURM_NTASKS_PER_NODE", &v, "expected a number such as 4"))?;
        return Ok(("SLURM_NTASKS_PER_NODE", counts.first().map(|&(c, _)| c)));
    }
    match var("SLURM_NNODES").as_deref() {
        Some("1") => Ok(("SLURM_NNODES", Some(world_size))),
        other => Err(config(
            "SLURM_TASKS_PER_NODE",
            "",
            format!(
                "unset, and SLURM_NNODES is {}: cannot tell how many ranks share this node; \
                 set LOCAL_RANK, LOCAL_WORLD_SIZE, RANK and WORLD_SIZE instead",
                other.unwrap_or("unset")
            ),
        )),
    }
}

/// `2(x3),1` → `[(2, 3), (1, 1)]`: (tasks, number of nodes with that many).
fn parse_tasks_per_node(value: &str) -> Option<Vec<(usize, usize)>> {
    value
        .split(',')
        .map(|part| {
            let part = part.trim();
            match part.split_once('(') {
                None => Some((part.parse().ok()?, 1)),
                Some((count, rest)) => {
                    let times = rest.strip_prefix('x')?.strip_suffix(')')?;
                    Some((count.trim().parse().ok()?, times.trim().parse().ok()?))
                }
            }
        })
        .collect()
}

/// The task count of node `n` in a run-length list.
fn nth_count(counts: &[(usize, usize)], mut n: usize) -> Option<usize> {
    for &(count, times) in counts {
        if n < times {
            return Some(count);
        }
        n -= times;
    }
    None
}

fn slurm_master(var: &impl Fn(&str) -> Option<String>) -> Result<String> {
    for name in ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"] {
        if let Some(list) = var(name) {
            return first_host(&list).ok_or_else(|| {
                config(
                    name,
                    &list,
                    "cannot read the first host of this node list; set MASTER_ADDR",
                )
            });
        }
    }
    Err(config(
        "MASTER_ADDR",
        "",
        "required when ranks span several nodes, and SLURM_STEP_NODELIST/SLURM_JOB_NODELIST \
         are unset: set it to the host name or address of rank 0's node",
    ))
}

/// The first host of a Slurm host list: `node[01-04],gpu5` → `node01`.
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let mut rest = &list[..end];
    let mut host = String::new();
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = open + rest[open..].find(']')?;
        let first = rest[open + 1..close].split([',', '-']).next()?.trim();
        if first.is_empty() || !first.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        host.push_str(first);
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return None;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchEnv::from_vars(|k| map.get(k).cloned())
    }

    /// The variable an `Error::Config` names, and its message.
    fn config_err(pairs: &[(&str, &str)]) -> (String, String) {
        match env(pairs) {
            Err(e) => match &e {
                Error::Config { name, .. } => (name.clone(), e.to_string()),
                _ => panic!("expected a configuration error, got {e}"),
            },
            Ok(v) => panic!("expected a configuration error, got {v:?}"),
        }
    }

    #[test]
    fn store_address_brackets_ipv6_literals() {
        let at = |addr: &str| {
            env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", addr)])
                .unwrap()
                .store_address()
        };
        assert_eq!(at("fd00::1"), "[fd00::1]:29500");
        assert_eq!(at("fe80::1%eth0"), "[fe80::1%eth0]:29500");
        assert_eq!(at("[fd00::1]"), "[fd00::1]:29500");
        assert_eq!(at("[fe80::1%eth0]"), "[fe80::1%eth0]:29500");
        assert_eq!(at("10.0.0.1"), "10.0.0.1:29500");
        assert_eq!(at("node7"), "node7:29500");
        let addr: std::net::SocketAddr = at("fd00::1").parse().unwrap();
        assert_eq!(addr.port(), 29500);
    }

    /// A port, scheme or path in MASTER_ADDR is refused at once, naming the
    /// variable, instead of a name that never resolves (every rank waited
    /// out its timeout, and rank 0 listed them all as never joined).
    #[test]
    fn master_addr_with_a_port_or_scheme_is_refused() {
        for addr in [
            "10.0.0.1:29500",
            "[::1]:29500",
            "tcp://h",
            "h/x",
            "node7:1",
            "[h]",
            "a b",
        ] {
            match env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", addr)]) {
                Err(Error::Config { name, .. }) => assert_eq!(name, "MASTER_ADDR", "{addr}"),
                other => panic!("{addr}: expected a configuration error, got {other:?}"),
            }
        }
    }

    #[test]
    fn torchrun() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "1234"),
        ])
        .unwrap();
        assert_eq!(
            e,
            LaunchEnv {
                rank: 3,
                world_size: 8,
                local_rank: 1,
                local_world_size: 2,
                master_addr: "node7".into(),
                master_port: 1234,
                source: LaunchSource::Torchrun,
                file_store: None,
                job_id: None,
            }
        );
    }

    #[test]
    fn single_node_defaults() {
        let e = env(&[("RANK", "2"), ("WORLD_SIZE", "4")]).unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (2, 4));
        assert_eq!(e.master_addr, "127.0.0.1");
        assert_eq!(e.master_port, 29500);
        // Only the local size given: block placement.
        let e = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (1, 4));
        // Empty values count as unset.
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "")]).unwrap();
        assert_eq!(e.master_addr, "127.0.0.1");
    }

    #[test]
    fn open_mpi() {
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("MASTER_ADDR", "10.0.0.1"),
        ])
        .unwrap();
        assert_eq!(e.source, LaunchSource::OpenMpi);
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        // Multi-node without MASTER_ADDR is an error that says why.
        let (name, msg) = config_err(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(name, "MASTER_ADDR");
        assert!(msg.contains("span several nodes"), "{msg}");
        assert!(msg.contains("OMPI_COMM_WORLD_LOCAL_SIZE=4"), "{msg}");
    }

    /// MPICH's and Intel MPI's Hydra `mpiexec`, alone and inside a Slurm
    /// allocation, where it starts one proxy per node with `srun` and its
    /// ranks inherit the proxy step's Slurm variables.
    #[test]
    fn hydra_pmi() {
        let hydra = [
            ("PMI_RANK", "6"),
            ("PMI_SIZE", "8"),
            ("MPI_LOCALRANKID", "2"),
            ("MPI_LOCALNRANKS", "4"),
            ("MASTER_ADDR", "n1"),
        ];
        let e = env(&hydra).unwrap();
        assert_eq!(e.source, LaunchSource::Pmi);
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (6, 8, 2, 4)
        );
        // Under Slurm: the proxy step's SLURM_PROCID (the node's index) and
        // SLURM_STEP_NUM_TASKS (the number of nodes) are not the rank's.
        let mut v = hydra.to_vec();
        v.extend([
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"),
        ]);
        let e = env(&v).unwrap();
        assert_eq!((e.source, e.rank, e.world_size), (LaunchSource::Pmi, 6, 8));
        // Slurm's PMI-2 plugin: PMI's pair equals Slurm's task, and Slurm's
        // variables (which say how many tasks share the node) are used.
        let e = env(&[
            ("PMI_RANK", "5"),
            ("PMI_SIZE", "8"),
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_NODELIST", "n[1-2]"),
        ])
        .unwrap();
        assert_eq!(e.source, LaunchSource::Slurm);
        assert_eq!((e.rank, e.local_rank, e.local_world_size), (5, 1, 4));
        assert_eq!(e.master_addr, "n1");
        // Cray PALS's local pair.
        let e = env(&[
            ("PMI_RANK", "6"),
            ("PMI_SIZE", "8"),
            ("PMI_LOCAL_RANK", "2"),
            ("PMI_LOCAL_SIZE", "4"),
            ("MASTER_ADDR", "n1"),
        ])
        .unwrap();
        assert_eq!(
            (e.source, e.local_rank, e.local_world_size),
            (LaunchSource::Pmi, 2, 4)
        );
        // No local pair at all (Flux): an error, not "every rank is local".
        let (name, msg) = config_err(&[("PMI_RANK", "3"), ("PMI_SIZE", "4")]);
        assert_eq!(name, "MPI_LOCALRANKID");
        assert!(msg.contains("LOCAL_WORLD_SIZE"), "{msg}");
        // ... unless torchrun's variables say it all.
        let e = env(&[
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
        ])
        .unwrap();
        assert_eq!(e.source, LaunchSource::Torchrun);
        // A stale RANK that disagrees with PMI's is named.
        let mut v = hydra.to_vec();
        v.extend([("RANK", "0"), ("WORLD_SIZE", "8")]);
        let (name, msg) = config_err(&v);
        assert_eq!(name, "RANK");
        assert!(msg.contains("PMI_RANK=6"), "{msg}");
        // Half a pair is an error.
        let (name, _) = config_err(&[("PMI_RANK", "1")]);
        assert_eq!(name, "PMI_RANK");
    }

    /// A per-node list whose counts differ needs this node's index; without
    /// one that names a node in it, the local size is not guessed.
    #[test]
    fn slurm_uneven_nodes_need_the_node_index() {
        let base = [
            ("SLURM_PROCID", "4"),
            ("SLURM_STEP_NUM_TASKS", "6"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_TASKS_PER_NODE", "4,2"),
            ("MASTER_ADDR", "h"),
        ];
        for node in [None, Some("x"), Some("5")] {
            let mut v = base.to_vec();
            v.extend(node.map(|n| ("SLURM_NODEID", n)));
            let (name, msg) = config_err(&v);
            assert_eq!(name, "SLURM_NODEID", "{node:?}");
            assert!(msg.contains("different task counts"), "{msg}");
        }
        // Equal counts need no index.
        let mut v = base.to_vec();
        v[3] = ("SLURM_STEP_TASKS_PER_NODE", "3(x2)");
        assert_eq!(env(&v).unwrap().local_world_size, 3);
    }

    #[test]
    fn slurm() {
        let base = [
            ("SLURM_PROCID", "5"),
            ("SLURM_STEP_NUM_TASKS", "6"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_TASKS_PER_NODE", "4,2"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ];
        let e = env(&base).unwrap();
        assert_eq!(e.source, LaunchSource::Slurm);
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 6, 1, 2)
        );
        assert_eq!(e.master_addr, "gpu07");
        // The step's node list wins over the job's.
        let mut v = base.to_vec();
        v.push(("SLURM_STEP_NODELIST", "cpu3,gpu[07-08]"));
        assert_eq!(env(&v).unwrap().master_addr, "cpu3");
        // Run-length lists and SLURM_NTASKS_PER_NODE.
        let e = env(&[
            ("SLURM_PROCID", "9"),
            ("SLURM_STEP_NUM_TASKS", "10"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "3"),
            ("SLURM_TASKS_PER_NODE", "3(x3),1"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!(e.local_world_size, 1);
        let (name, _) = config_err(&[
            ("SLURM_PROCID", "8"),
            ("SLURM_STEP_NUM_TASKS", "10"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_NODEID", "2"),
            ("SLURM_TASKS_PER_NODE", "3(x3),1"),
            ("MASTER_ADDR", "h"),
        ]);
        assert_eq!(name, "SLURM_LOCALID");
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_STEP_NUM_TASKS", "8"),
            ("SLURM_LOCALID", "3"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("MASTER_ADDR", "h"),
        ])
        .unwrap();
        assert_eq!(e.local_world_size, 4);
        // One node: the local size is the world size.
        let e = env(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NNODES", "1"),
        ])
        .unwrap();
        assert_eq!((e.local_rank, e.local_world_size), (1, 2));
        assert_eq!(e.master_addr, "127.0.0.1");
        // Several nodes and no layout: an error naming the missing variable.
        let (name, _) = config_err(&[("SLURM_PROCID", "1"), ("SLURM_STEP_NUM_TASKS", "2")]);
        assert_eq!(name, "SLURM_TASKS_PER_NODE");
        // A batch script (what sbatch sets: SLURM_PROCID=0 and the
        // allocation's SLURM_NTASKS, but no SLURM_STEP_NUM_TASKS, which
        // only srun sets) is no launcher: one process, not task 0 of four.
        let batch = [
            ("SLURM_PROCID", "0"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NNODES", "1"),
            ("SLURM_TASKS_PER_NODE", "4"),
        ];
        let (name, msg) = config_err(&batch);
        assert_eq!(name, "RANK");
        assert!(msg.contains("no launcher variables found"), "{msg}");
        // Ranks a script starts by hand (or another launcher) inside it are
        // not compared with the script's SLURM_PROCID.
        let mut v = batch.to_vec();
        v.extend([("RANK", "2"), ("WORLD_SIZE", "4")]);
        let e = env(&v).unwrap();
        assert_eq!(
            (e.source, e.rank, e.world_size),
            (LaunchSource::Torchrun, 2, 4)
        );
        let (name, _) = config_err(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_TASKS_PER_NODE", "two"),
        ]);
        assert_eq!(name, "SLURM_TASKS_PER_NODE");
        let (name, _) = config_err(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NUM_TASKS", "4"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
            ("SLURM_JOB_NODELIST", "node[01"),
        ]);
        assert_eq!(name, "SLURM_JOB_NODELIST");
    }

    #[test]
    fn precedence_and_disagreement() {
        let ompi = [("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2")];
        let mut v = ompi.to_vec();
        v.extend([("RANK", "1"), ("WORLD_SIZE", "2")]);
        assert_eq!(env(&v).unwrap().source, LaunchSource::Torchrun);

        let mut v = ompi.to_vec();
        v.extend([("RANK", "0"), ("WORLD_SIZE", "2")]);
        let (name, msg) = config_err(&v);
        assert_eq!(name, "RANK");
        assert!(
            msg.contains(
                "RANK=0 but OMPI_COMM_WORLD_RANK=1: two launchers' variables disagree; unset one"
            ),
            "{msg}"
        );
        let mut v = ompi.to_vec();
        v.extend([("RANK", "1"), ("WORLD_SIZE", "3")]);
        let (name, msg) = config_err(&v);
        assert_eq!(name, "WORLD_SIZE");
        assert!(
            msg.contains("WORLD_SIZE=3 but OMPI_COMM_WORLD_SIZE=2"),
            "{msg}"
        );

        let slurm = [
            ("SLURM_PROCID", "0"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_NNODES", "1"),
        ];
        let mut v = slurm.to_vec();
        v.extend([("RANK", "1"), ("WORLD_SIZE", "2")]);
        let (_, msg) = config_err(&v);
        assert!(msg.contains("RANK=1 but SLURM_PROCID=0"), "{msg}");
        // torchrun under srun: torchrun's variables describe this process.
        v.push(("TORCHELASTIC_RUN_ID", "job"));
        assert_eq!(env(&v).unwrap().rank, 1);

        // Open MPI wins over Slurm, whose batch variables it inherits.
        let mut v = ompi.to_vec();
        v.extend(slurm);
        let e = env(&v).unwrap();
        assert_eq!((e.source, e.rank), (LaunchSource::OpenMpi, 1));
        // So does a wrapper's `export RANK=$OMPI_COMM_WORLD_RANK` under
        // mpirun in an allocation: checked against Open MPI's, not Slurm's.
        v.extend([("RANK", "1"), ("WORLD_SIZE", "2")]);
        let e = env(&v).unwrap();
        assert_eq!((e.source, e.rank), (LaunchSource::Torchrun, 1));
        v.retain(|&(name, _)| name != "RANK");
        v.push(("RANK", "0"));
        let (_, msg) = config_err(&v);
        assert!(msg.contains("RANK=0 but OMPI_COMM_WORLD_RANK=1"), "{msg}");
    }

    #[test]
    fn each_error_names_its_variable() {
        let cases: &[(&[(&str, &str)], &str)] = &[
            (&[("RANK", "x"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0"), ("WORLD_SIZE", "-2")], "WORLD_SIZE"),
            (&[("RANK", "0"), ("WORLD_SIZE", "0")], "WORLD_SIZE"),
            // Past what a job may have: an error, not an allocation.
            (
                &[("RANK", "0"), ("WORLD_SIZE", "10000000000000")],
                "WORLD_SIZE",
            ),
            (&[("RANK", "2"), ("WORLD_SIZE", "2")], "RANK"),
            (&[("RANK", "0")], "RANK"),
            (&[("WORLD_SIZE", "2")], "WORLD_SIZE"),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_RANK", "2"),
                    ("LOCAL_WORLD_SIZE", "2"),
                ],
                "LOCAL_RANK",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "5"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "4"),
                    ("LOCAL_WORLD_SIZE", "0"),
                ],
                "LOCAL_WORLD_SIZE",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "z")],
                "LOCAL_RANK",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")],
                "MASTER_PORT",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "70000")],
                "MASTER_PORT",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "http")],
                "MASTER_PORT",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("OXCCL_STORE", "tcp")],
                "OXCCL_STORE",
            ),
            (
                &[("RANK", "0"), ("WORLD_SIZE", "1"), ("OXCCL_STORE", "file:")],
                "OXCCL_STORE",
            ),
            (&[("OMPI_COMM_WORLD_RANK", "1")], "OMPI_COMM_WORLD_RANK"),
            (&[], "RANK"),
        ];
        for (vars, expected) in cases {
            let (name, msg) = config_err(vars);
            assert_eq!(&name, expected, "{vars:?}: {msg}");
            if let Some((_, value)) = vars.iter().find(|(k, _)| k == expected) {
                assert!(msg.contains(&format!("{expected}={value:?}")), "{msg}");
            }
        }
        let (_, msg) = config_err(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
        assert!(msg.contains("less than WORLD_SIZE=4"), "{msg}");
        let (_, msg) = config_err(&[("RANK", "0")]);
        assert!(msg.contains("RANK is set but WORLD_SIZE is not"), "{msg}");
    }

    #[test]
    fn store_selection_and_job_id() {
        let e = env(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("OXCCL_STORE", "file:/shared/job"),
            ("OXCCL_JOB_ID", "j42"),
        ])
        .unwrap();
        assert_eq!(e.file_store, Some(PathBuf::from("/shared/job")));
        assert_eq!(e.job_id.as_deref(), Some("j42"));
    }

    #[test]
    fn agent_store_shifts_the_port() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "29400")];
        assert_eq!(env(&base).unwrap().master_port, 29400);
        let mut v = base.to_vec();
        v.push(("TORCHELASTIC_USE_AGENT_STORE", "True"));
        assert_eq!(env(&v).unwrap().master_port, 29401);
        let mut v = base.to_vec();
        v.push(("TORCHELASTIC_USE_AGENT_STORE", "False"));
        assert_eq!(env(&v).unwrap().master_port, 29400);
        let (name, _) = config_err(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "65535"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]);
        assert_eq!(name, "MASTER_PORT");
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node01").as_deref(), Some("node01"));
        assert_eq!(first_host("node[01-04]").as_deref(), Some("node01"));
        assert_eq!(first_host("node[01,03],gpu5").as_deref(), Some("node01"));
        assert_eq!(first_host("node[03,01-02]").as_deref(), Some("node03"));
        assert_eq!(first_host("a-b[1-2]").as_deref(), Some("a-b1"));
        assert_eq!(first_host("gpu5,node[01-02]").as_deref(), Some("gpu5"));
        assert_eq!(
            first_host("rack[2-3]-n[007-009]").as_deref(),
            Some("rack2-n007")
        );
        assert_eq!(first_host(" n1 ").as_deref(), Some("n1"));
        for bad in [
            "",
            "node[01",
            "node]01",
            "node[]",
            "node[a-b]",
            "[[1]]",
            ",",
        ] {
            assert_eq!(first_host(bad), None, "{bad:?}");
        }
        assert_eq!(parse_tasks_per_node("4"), Some(vec![(4, 1)]));
        assert_eq!(parse_tasks_per_node("4(x2)"), Some(vec![(4, 2)]));
        assert_eq!(parse_tasks_per_node("2(x3),1"), Some(vec![(2, 3), (1, 1)]));
        assert_eq!(parse_tasks_per_node("2,1"), Some(vec![(2, 1), (1, 1)]));
        assert_eq!(parse_tasks_per_node("2(3)"), None);
        assert_eq!(nth_count(&[(2, 3), (1, 1)], 3), Some(1));
        assert_eq!(nth_count(&[(2, 3), (1, 1)], 4), None);
    }
}
