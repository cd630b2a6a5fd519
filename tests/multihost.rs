//! Three "hosts" built from network namespaces, joined by a bridge, running
//! every collective across them over TCP (and shared memory within each).
//!
//! Namespaces `oxh<PID>-0..2` are the hosts; `oxh<PID>-hub` holds a bridge
//! `br0`. Host `i` has a decoy interface `aa0` (`10.214.0.<i+1>/24`, a
//! dummy device, or a bridge without ports where the kernel has no dummy
//! module; listed first, reaching nobody) and a veth `oxv0` (`10.213.0.<i+1>/24`)
//! whose other end is enslaved to `br0`. The root namespace's network is
//! never touched, and every namespace is deleted at the end, also when the
//! test fails (a `Drop` guard).
//!
//! Seven runs of `oxccl-check --quick`, every process started together:
//! the first three and the last under `oxccl-run`, one launcher per host, the others
//! rank by rank:
//! 1. `OXCCL_SOCKET_IFNAME=oxv`, 2 ranks per host: every rank passes over
//!    `shm+tcp (oxv0 <its own address>)` (its small calls run the direct
//!    schedules in two levels, its large ones the rings).
//! 2. `OXCCL_SOCKET_IFNAME==aa0` (the decoy), 1 rank per host: it must fail,
//!    within a bounded time, saying what it could not reach.
//! 3. No `OXCCL_SOCKET_IFNAME`, 1 rank per host: the interface toward
//!    `MASTER_ADDR` (the veth) is chosen, and every rank passes.
//! 4. Ranks started one by one with the launchers' variables, placed
//!    round-robin (rank `r` on host `r % 3`), every call on the ring
//!    (`OXCCL_ALGO=ring`): every rank passes, and with `OXCCL_DEBUG=INFO`
//!    says its ring stands each host's ranks together.
//! 5. The same placement, every call direct (`OXCCL_ALGO=direct`): the
//!    direct schedules in two levels, along rails of ranks that are not
//!    neighbours in rank order.
//! 6. Five ranks round-robin, so the hosts run 2, 2 and 1: the ring in
//!    host order in one level, and small calls through each host's leader.
//! 7. As run 1 with host 2's egress throttled (`tc tbf`, 100 Mbit/s), and
//!    `--links`: rank 0 names ranks 4 and 5 (host 2) as those every TCP
//!    link out of is slow.
//!
//! Needs root, `ip netns` and `nsenter`; without them the test is
//! skipped, unless `CI` is set, where it fails.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

const LAUNCHER: &str = env!("CARGO_BIN_EXE_oxccl-run");
const CHECK: &str = env!("CARGO_BIN_EXE_oxccl-check");
const HOSTS: usize = 3;
const MASTER_ADDR: &str = "10.213.0.1";
const MASTER_PORT: &str = "29400";

/// Runs `ip ARGS`, returning its stderr on failure.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run `ip {}`: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Runs `ip ARGS`, panicking on failure.
fn ip_ok(args: &[&str]) {
    if let Err(e) = ip(args) {
        panic!("setting up the namespaces: {e}");
    }
}

/// The namespaces of one test; deletes them all when dropped (deleting a
/// namespace deletes its veth ends and its dummy and bridge devices).
struct Net {
    hub: String,
    hosts: Vec<String>,
    /// Namespaces created so far, deleted in reverse on drop.
    created: Vec<String>,
}

impl Net {
    fn names() -> (String, Vec<String>) {
        let pid = std::process::id();
        let hub = format!("oxh{pid}-hub");
        let hosts = (0..HOSTS).map(|i| format!("oxh{pid}-{i}")).collect();
        (hub, hosts)
    }

    /// Creates the hub namespace, or says why it cannot (no root, no
    /// `ip`, no permission to create namespaces).
    fn probe() -> Result<Net, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("not running as root".into());
        }
        ip(&["netns", "list"])?;
        // Run 4 starts ranks in a host's network namespace with `nsenter`.
        let nsenter = Command::new("nsenter")
            .arg("--version")
            .stdout(Stdio::null())
            .status();
        if !nsenter.is_ok_and(|s| s.success()) {
            return Err("no `nsenter` (util-linux)".into());
        }
        let (hub, hosts) = Net::names();
        // A namespace of this name left by a crashed run of the same pid.
        let _ = ip(&["netns", "del", &hub]);
        ip(&["netns", "add", &hub])?;
        Ok(Net {
            hub: hub.clone(),
            hosts,
            created: vec![hub],
        })
    }

    fn add_ns(&mut self, name: &str) {
        let _ = ip(&["netns", "del", name]);
        ip_ok(&["netns", "add", name]);
        self.created.push(name.to_string());
    }

    /// Builds the bridge, the hosts, their decoys and their veths.
    fn build(&mut self) {
        let hub = self.hub.clone();
        ip_ok(&["-n", &hub, "link", "set", "lo", "up"]);
        ip_ok(&["-n", &hub, "link", "add", "br0", "type", "bridge"]);
        ip_ok(&["-n", &hub, "link", "set", "br0", "up"]);
        for (i, ns) in self.hosts.clone().iter().enumerate() {
            self.add_ns(ns);
            ip_ok(&["-n", ns, "link", "set", "lo", "up"]);
            // The decoy first, so the OS lists it before the veth.
            let decoy = format!("10.214.0.{}/24", i + 1);
            // A dummy device where the kernel has the module; else a bridge
            // with no ports, which reaches nobody just the same.
            if let Err(e) = ip(&["-n", ns, "link", "add", "aa0", "type", "dummy"]) {
                if i == 0 {
                    eprintln!("multihost: {e}; the decoy aa0 is a bridge without ports");
                }
                ip_ok(&["-n", ns, "link", "add", "aa0", "type", "bridge"]);
            }
            ip_ok(&["-n", ns, "addr", "add", &decoy, "dev", "aa0"]);
            ip_ok(&["-n", ns, "link", "set", "aa0", "up"]);
            // The veth is created inside the host namespace with its peer
            // in the hub: the root namespace never holds either end.
            let peer = format!("p{i}");
            ip_ok(&[
                "-n", ns, "link", "add", "oxv0", "type", "veth", "peer", "name", &peer, "netns",
                &hub,
            ]);
            ip_ok(&["-n", &hub, "link", "set", &peer, "master", "br0"]);
            ip_ok(&["-n", &hub, "link", "set", &peer, "up"]);
            let addr = format!("10.213.0.{}/24", i + 1);
            ip_ok(&["-n", ns, "addr", "add", &addr, "dev", "oxv0"]);
            ip_ok(&["-n", ns, "link", "set", "oxv0", "up"]);
        }
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for ns in self.created.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("multihost: cleanup: {e}");
            }
        }
    }
}

/// The launchers of one run; any still running when this drops (a panic)
/// are killed, and with them their ranks (`oxccl-run` gives each rank
/// `PR_SET_PDEATHSIG`).
struct Launchers(Vec<Option<Child>>);

impl Drop for Launchers {
    fn drop(&mut self) {
        for child in self.0.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

struct NodeResult {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

struct RunResult {
    nodes: Vec<NodeResult>,
    elapsed: Duration,
}

fn collect(mut pipe: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        let _ = tx.send(String::from_utf8_lossy(&bytes).into_owned());
    });
    rx
}

/// How a run places its ranks on the hosts.
#[derive(Clone, Copy)]
enum Placement {
    /// One `oxccl-run` per host, `nproc` ranks each, numbered host by host
    /// (as `torchrun` does); its output lines carry `[rank R] `.
    Launchers { nproc: usize },
    /// Rank `r` of `world` on host `r % HOSTS`, each started on its own
    /// with the launchers' variables (`mpirun --map-by node`, Slurm's
    /// cyclic distribution): hosts' ranks are not consecutive, and with a
    /// world that `HOSTS` does not divide the hosts run unequal numbers.
    RoundRobin { world: usize },
}

/// The command of each process of a run and the host it runs on: the
/// launchers, or every rank; every rank runs `oxccl-check --quick` and
/// `extra` arguments.
fn commands(net: &Net, placement: Placement, extra: &[&str]) -> Vec<(usize, Command)> {
    let in_host = |ns: &str, program: &str| {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, program]);
        cmd
    };
    let hosts = &net.hosts;
    match placement {
        Placement::Launchers { nproc } => {
            let (nproc, nnodes) = (nproc.to_string(), HOSTS.to_string());
            hosts
                .iter()
                .enumerate()
                .map(|(i, ns)| {
                    let mut cmd = in_host(ns, LAUNCHER);
                    cmd.args(["--nnodes", &nnodes, "--node-rank", &i.to_string()])
                        .args(["--master-addr", MASTER_ADDR, "--master-port", MASTER_PORT])
                        .args(["--nproc-per-node", &nproc, "--", CHECK, "--quick"])
                        .args(extra);
                    (i, cmd)
                })
                .collect()
        }
        Placement::RoundRobin { world } => {
            (0..world)
                .map(|rank| {
                    let host = rank % HOSTS;
                    let on_host = (0..world).filter(|r| r % HOSTS == host).count();
                    // Not `ip netns exec`: each of its runs mounts its own
                    // /sys in a mount namespace of its own, and ranks in
                    // different mount namespaces are different hosts to
                    // oxccl (`host_identity`). `nsenter` enters only the
                    // network namespace, so a host's ranks share memory.
                    let mut cmd = Command::new("nsenter");
                    cmd.arg(format!("--net=/run/netns/{}", hosts[host]))
                        .args([CHECK, "--quick"])
                        .args(extra)
                        .env("RANK", rank.to_string())
                        .env("WORLD_SIZE", world.to_string())
                        .env("LOCAL_RANK", (rank / HOSTS).to_string())
                        .env("LOCAL_WORLD_SIZE", on_host.to_string())
                        .env("MASTER_ADDR", MASTER_ADDR)
                        .env("MASTER_PORT", MASTER_PORT);
                    (host, cmd)
                })
                .collect()
        }
    }
}

/// Starts every process of `placement` at once, with a clean environment
/// plus `env` (and the ranks' variables); waits for all of them, killing
/// every one still running after `deadline` and failing. One result per
/// process (per host for launchers, per rank otherwise).
fn run_job(net: &Net, placement: Placement, env: &[(&str, &str)], deadline: Duration) -> RunResult {
    run_job_with(net, placement, env, &[], deadline)
}

/// [`run_job`], every rank's `oxccl-check` with `extra` arguments.
fn run_job_with(
    net: &Net,
    placement: Placement,
    env: &[(&str, &str)],
    extra: &[&str],
    deadline: Duration,
) -> RunResult {
    let started = Instant::now();
    let mut launchers = Launchers(Vec::new());
    let mut pipes = Vec::new();
    let processes = commands(net, placement, extra);
    let count = processes.len();
    for (i, (host, mut cmd)) in processes.into_iter().enumerate() {
        // Nothing of the caller's job (OXCCL_*, MASTER_*, SLURM_*,
        // TORCHELASTIC_*) leaks in: cleared, then the ranks' variables
        // set again.
        let ranks_vars: Vec<_> = cmd
            .get_envs()
            .map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned())))
            .collect();
        cmd.env_clear();
        for (k, v) in ranks_vars {
            if let Some(v) = v {
                cmd.env(k, v);
            }
        }
        cmd.env("PATH", std::env::var_os("PATH").unwrap_or_default())
            // All namespaces share one /dev/shm: a job id of this test
            // process's own keeps concurrent runs' segment names apart.
            .env("OXCCL_JOB_ID", format!("multihost{}", std::process::id()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start process {i} (host {host}): {e}"));
        pipes.push((
            collect(child.stdout.take().unwrap()),
            collect(child.stderr.take().unwrap()),
        ));
        launchers.0.push(Some(child));
    }
    let mut codes = vec![None; count];
    let mut done = vec![false; count];
    while !done.iter().all(|&d| d) {
        for i in 0..count {
            if done[i] {
                continue;
            }
            let child = launchers.0[i].as_mut().unwrap();
            if let Some(status) = child.try_wait().unwrap() {
                codes[i] = status.code();
                done[i] = true;
                launchers.0[i] = None;
            }
        }
        if started.elapsed() > deadline {
            let running: Vec<usize> = (0..count).filter(|&i| !done[i]).collect();
            drop(launchers);
            let mut outputs = String::new();
            for (i, (out, err)) in pipes.iter().enumerate() {
                let grace = Duration::from_secs(5);
                outputs += &format!(
                    "--- process {i} stdout\n{}--- process {i} stderr\n{}",
                    out.recv_timeout(grace).unwrap_or_default(),
                    err.recv_timeout(grace).unwrap_or_default()
                );
            }
            panic!(
                "processes {running:?} still running after {deadline:?}; \
                 killed them\n{outputs}"
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
    let elapsed = started.elapsed();
    let grace = Duration::from_secs(5);
    let nodes = pipes
        .into_iter()
        .zip(codes)
        .enumerate()
        .map(|(i, ((out, err), code))| {
            let node = NodeResult {
                code,
                stdout: out
                    .recv_timeout(grace)
                    .unwrap_or_else(|_| panic!("process {i}: stdout still open")),
                stderr: err
                    .recv_timeout(grace)
                    .unwrap_or_else(|_| panic!("process {i}: stderr still open")),
            };
            eprintln!(
                "--- process {i}: exit {:?}\n--- stdout\n{}--- stderr\n{}",
                node.code, node.stdout, node.stderr
            );
            node
        })
        .collect();
    eprintln!("--- all processes done after {elapsed:?}");
    RunResult { nodes, elapsed }
}

/// Checks that every rank of every host passed over `transport(host)`.
fn assert_all_correct(r: &RunResult, placement: Placement, transport: impl Fn(usize) -> String) {
    let (per_host, world, launchers) = match placement {
        Placement::Launchers { nproc } => (nproc, HOSTS * nproc, true),
        Placement::RoundRobin { world } => (world.div_ceil(HOSTS), world, false),
    };
    for rank in 0..world {
        // Which process printed the rank's line, on which host.
        let (process, host) = if launchers {
            (rank / per_host, rank / per_host)
        } else {
            (rank, rank % HOSTS)
        };
        let node = &r.nodes[process];
        assert_eq!(
            node.code,
            Some(0),
            "process {process} (host {host}) failed\n{}{}",
            node.stdout,
            node.stderr
        );
        let prefix = if launchers {
            format!("[rank {rank}] ")
        } else {
            String::new()
        };
        let want = format!(
            "{prefix}oxccl-check: rank {rank}/{world}: every collective correct over {}, counts ",
            transport(host)
        );
        assert!(
            node.stdout.lines().any(|l| l.starts_with(&want)),
            "process {process}: no line starting {want:?} in\n{}{}",
            node.stdout,
            node.stderr
        );
    }
}

#[test]
fn collectives_across_three_namespace_hosts() {
    let mut net = match Net::probe() {
        Ok(net) => net,
        Err(why) => {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "multihost: needs root, `ip netns` and `nsenter` ({why}); CI must run \
                     this test (install iproute2 and util-linux, and run as root)"
                );
            }
            eprintln!("\n*** SKIPPED: needs root and ip netns ({why}) ***\n");
            return;
        }
    };
    net.build();
    let total = Instant::now();

    // 1. Two ranks per host: shm within a host, TCP over the veths.
    eprintln!("=== run 1: OXCCL_SOCKET_IFNAME=oxv, 3 hosts x 2 ranks");
    let good = run_job(
        &net,
        Placement::Launchers { nproc: 2 },
        &[("OXCCL_SOCKET_IFNAME", "oxv"), ("OXCCL_TIMEOUT", "20s")],
        Duration::from_secs(90),
    );
    assert_all_correct(&good, Placement::Launchers { nproc: 2 }, |i| {
        format!("shm+tcp (oxv0 10.213.0.{})", i + 1)
    });

    // 2. The decoy: it is up and has an address, but reaches nobody.
    eprintln!("=== run 2: OXCCL_SOCKET_IFNAME==aa0 (the decoy), 3 hosts x 1 rank");
    let decoy_deadline = Duration::from_secs(40);
    let bad = run_job(
        &net,
        Placement::Launchers { nproc: 1 },
        &[("OXCCL_SOCKET_IFNAME", "=aa0"), ("OXCCL_TIMEOUT", "3s")],
        decoy_deadline,
    );
    assert!(bad.elapsed < decoy_deadline, "{:?}", bad.elapsed);
    for (i, node) in bad.nodes.iter().enumerate() {
        assert!(
            node.code.is_some_and(|c| c != 0),
            "host {i}: the decoy run exited {:?}, not with a failure\n{}{}",
            node.code,
            node.stdout,
            node.stderr
        );
    }
    let said_why = bad.nodes.iter().any(|n| {
        n.stderr.lines().chain(n.stdout.lines()).any(|l| {
            l.contains("oxccl-check: FAILED")
                && ["connect", "never joined", "timed out"]
                    .iter()
                    .any(|w| l.contains(w))
        })
    });
    assert!(
        said_why,
        "no rank said what it could not reach: {}",
        bad.nodes
            .iter()
            .map(|n| format!("{}{}", n.stdout, n.stderr))
            .collect::<String>()
    );
    // The decoy was really used, not silently replaced.
    assert!(
        bad.nodes
            .iter()
            .any(|n| n.stderr.contains("10.214.0.") || n.stdout.contains("10.214.0.")),
        "no rank's error names a decoy address"
    );

    // 3. No OXCCL_SOCKET_IFNAME: the interface toward MASTER_ADDR wins.
    eprintln!("=== run 3: no OXCCL_SOCKET_IFNAME, 3 hosts x 1 rank");
    let auto = run_job(
        &net,
        Placement::Launchers { nproc: 1 },
        &[("OXCCL_TIMEOUT", "20s")],
        Duration::from_secs(60),
    );
    assert_all_correct(&auto, Placement::Launchers { nproc: 1 }, |i| {
        format!("tcp (oxv0 10.213.0.{})", i + 1)
    });

    // 4. Ranks placed round-robin (rank r on host r % 3), every call on
    // the ring: the ring stands each host's ranks together (0 3 | 1 4 |
    // 2 5), crossing between hosts three times rather than at every step,
    // and all-reduce, reduce-scatter and all-gather run it in two levels
    // (within each host, then along the rails 0 1 2 and 3 4 5).
    eprintln!("=== run 4: round-robin placement, 3 hosts x 2 ranks, OXCCL_ALGO=ring");
    let round_robin = Placement::RoundRobin { world: 6 };
    let cyclic = run_job(
        &net,
        round_robin,
        &[
            ("OXCCL_SOCKET_IFNAME", "oxv"),
            ("OXCCL_TIMEOUT", "20s"),
            ("OXCCL_ALGO", "ring"),
            ("OXCCL_DEBUG", "INFO"),
        ],
        Duration::from_secs(90),
    );
    assert_all_correct(&cyclic, round_robin, |i| {
        format!("shm+tcp (oxv0 10.213.0.{})", i + 1)
    });
    for (rank, node) in cyclic.nodes.iter().enumerate() {
        let want = format!(
            "oxccl INFO rank {rank}/6: ring 0 3 1 4 2 5 (two levels: 3 hosts x 2 ranks) over "
        );
        assert!(
            node.stderr.lines().any(|l| l.starts_with(&want)),
            "rank {rank}: no line starting {want:?} in\n{}",
            node.stderr
        );
    }

    // 5. The same placement, every call direct: all-reduce, reduce-scatter,
    // all-gather, broadcast and reduce run in two levels along the rails
    // 0 1 2 and 3 4 5 (broadcast and reduce through the rank at the
    // root's place on each host).
    eprintln!("=== run 5: round-robin placement, 3 hosts x 2 ranks, OXCCL_ALGO=direct");
    let direct = run_job(
        &net,
        round_robin,
        &[
            ("OXCCL_SOCKET_IFNAME", "oxv"),
            ("OXCCL_TIMEOUT", "20s"),
            ("OXCCL_ALGO", "direct"),
        ],
        Duration::from_secs(90),
    );
    assert_all_correct(&direct, round_robin, |i| {
        format!("shm+tcp (oxv0 10.213.0.{})", i + 1)
    });

    // 6. Five ranks round-robin: hosts of 2, 2 and 1 (0 3 | 1 4 | 2). The
    // ring stands each host's ranks together in one level; small calls go
    // through each host's leader (0, 1, 2).
    eprintln!("=== run 6: round-robin placement, 5 ranks on 3 hosts (2, 2, 1)");
    let uneven = Placement::RoundRobin { world: 5 };
    let leaders = run_job(
        &net,
        uneven,
        &[
            ("OXCCL_SOCKET_IFNAME", "oxv"),
            ("OXCCL_TIMEOUT", "20s"),
            ("OXCCL_DEBUG", "INFO"),
        ],
        Duration::from_secs(90),
    );
    assert_all_correct(&leaders, uneven, |i| {
        let link = if i == 2 { "tcp" } else { "shm+tcp" };
        format!("{link} (oxv0 10.213.0.{})", i + 1)
    });
    for (rank, node) in leaders.nodes.iter().enumerate() {
        let want = format!("oxccl INFO rank {rank}/5: ring 0 3 1 4 2 (hosts of 2 2 1 ranks) over ");
        assert!(
            node.stderr.lines().any(|l| l.starts_with(&want)),
            "rank {rank}: no line starting {want:?} in\n{}",
            node.stderr
        );
    }

    // 7. Host 2's egress throttled to 100 Mbit/s (a NIC that came up
    // slow): `oxccl-check --links` names its ranks (4 and 5) as the ones
    // every TCP link out of is slow.
    eprintln!("=== run 7: host 2's egress at 100 Mbit/s, 3 hosts x 2 ranks, --links");
    let tbf = [
        "root", "tbf", "rate", "100mbit", "burst", "32k", "latency", "100ms",
    ];
    let shaped = Command::new("ip")
        .args([
            "netns",
            "exec",
            &net.hosts[2],
            "tc",
            "qdisc",
            "add",
            "dev",
            "oxv0",
        ])
        .args(tbf)
        .status();
    match shaped {
        Ok(status) if status.success() => {}
        // As the namespaces themselves: required under CI, else skipped.
        other if std::env::var_os("CI").is_some() => {
            panic!("multihost run 7 needs `tc` and the tbf qdisc: {other:?}")
        }
        other => {
            eprintln!("\n*** run 7 SKIPPED: no `tc` or no tbf qdisc ({other:?}) ***\n");
            return;
        }
    }
    let throttled = run_job_with(
        &net,
        Placement::Launchers { nproc: 2 },
        &[("OXCCL_SOCKET_IFNAME", "oxv"), ("OXCCL_TIMEOUT", "20s")],
        &["--links", "--link-bytes", "256K"],
        Duration::from_secs(90),
    );
    assert_all_correct(&throttled, Placement::Launchers { nproc: 2 }, |i| {
        format!("shm+tcp (oxv0 10.213.0.{})", i + 1)
    });
    // Only the named ranks are asserted: six ranks on two CPUs slow some
    // healthy links by half as well (the report says the machine is
    // crowded), so which others cross the line varies between runs; the
    // unit tests of `check/links.rs` pin the rule itself.
    let report = &throttled.nodes[0].stdout;
    for rank in [4, 5] {
        let named = format!(
            "[rank 0] oxccl-check: links: WARNING every tcp link out of rank {rank} is slow"
        );
        assert!(report.contains(&named), "rank {rank} not named:\n{report}");
    }

    eprintln!(
        "=== runs took {:?}, {:?} (decoy, failing as it must), {:?}, {:?}, {:?}, {:?}, {:?}; \
         {:?} in all",
        good.elapsed,
        bad.elapsed,
        auto.elapsed,
        cyclic.elapsed,
        direct.elapsed,
        leaders.elapsed,
        throttled.elapsed,
        total.elapsed()
    );
}
