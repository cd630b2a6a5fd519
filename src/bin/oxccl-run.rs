//! oxccl-run: starts the ranks of a job on this node, in the spirit of
//! `torchrun --no-python` and `mpirun`. A thin command line over
//! [`oxccl::launch`].

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use oxccl::launch::{launch, Bind, LaunchSpec};

const USAGE: &str = "\
usage: oxccl-run [options] [--] PROGRAM [ARGS...]
  --nproc-per-node N   ranks on this node (default 1; also -np N)
  --nnodes N           nodes in the job (default 1)
  --node-rank R        this node's index, below --nnodes (default 0)
  --master-addr A      address of node 0, where rank 0 hosts the store (default 127.0.0.1)
  --master-port P      port of the store (default 29500)
  --kill-grace SECS    time between SIGTERM and SIGKILL when stopping ranks (default 5)
  --bind-to core|none|auto
                       core: local rank i on the i-th allowed CPU; auto (default): when
                       there are at least as many CPUs as local ranks, each rank on its
                       own contiguous share of them (all of them with one rank)
  --no-prefix          do not prefix output lines with [rank R]
  -h, --help           this text
torchrun spellings (--nproc_per_node, --node_rank, --master_addr, --master_port)
and --option=value forms are accepted. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR, MASTER_PORT and OXCCL_JOB_ID.
When one rank fails the others are stopped; the exit status is the first failing
rank's (128+N for signal N).";

/// What the command line asked for.
enum Parsed {
    Run(LaunchSpec),
    Help,
}

fn parse_number<T: std::str::FromStr>(flag: &str, value: &str) -> Result<T, String> {
    value
        .parse()
        .map_err(|_| format!("{flag}: expected a number, got {value:?}"))
}

fn parse_args(mut args: impl Iterator<Item = OsString>) -> Result<Parsed, String> {
    let mut spec = LaunchSpec::new(OsString::new());
    // This process only launches: what the ranks leave behind is the job's.
    spec.adopt_orphans = true;
    let mut program: Option<OsString> = None;
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str() else {
            if arg.as_encoded_bytes().starts_with(b"-") {
                return Err(format!("unknown option {arg:?}"));
            }
            program = Some(arg);
            break;
        };
        if text == "--" {
            program = args.next();
            break;
        }
        if !text.starts_with('-') || text == "-" {
            program = Some(arg);
            break;
        }
        let (flag, inline) = match text.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (text.to_string(), None),
        };
        let takes_value = !matches!(
            flag.as_str(),
            "-h" | "--help" | "--no-prefix" | "--no_prefix"
        );
        let value = if takes_value {
            match inline {
                Some(v) => v,
                None => args
                    .next()
                    .and_then(|v| v.into_string().ok())
                    .ok_or_else(|| format!("{flag} needs a value"))?,
            }
        } else {
            if inline.is_some() {
                return Err(format!("{flag} takes no value"));
            }
            String::new()
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--no-prefix" | "--no_prefix" => spec.prefix_output = false,
            "--nproc-per-node" | "--nproc_per_node" | "-np" => {
                spec.nproc_per_node = parse_number(&flag, &value)?;
                if spec.nproc_per_node == 0 {
                    return Err(format!("{flag}: expected at least 1"));
                }
            }
            "--nnodes" => {
                spec.nnodes = parse_number(&flag, &value)?;
                if spec.nnodes == 0 {
                    return Err(format!("{flag}: expected at least 1"));
                }
            }
            "--node-rank" | "--node_rank" => spec.node_rank = parse_number(&flag, &value)?,
            "--master-addr" | "--master_addr" => {
                if value.is_empty() {
                    return Err(format!("{flag}: expected an address"));
                }
                spec.master_addr = value;
            }
            "--master-port" | "--master_port" => {
                spec.master_port =
                    value
                        .parse()
                        .ok()
                        .filter(|&p: &u16| p != 0)
                        .ok_or_else(|| {
                            format!("{flag}: expected a port in 1..=65535, got {value:?}")
                        })?;
            }
            "--bind-to" | "--bind_to" => {
                spec.bind = Bind::from_name(&value)
                    .ok_or_else(|| format!("{flag}: expected core, none or auto, got {value:?}"))?;
            }
            "--kill-grace" | "--kill_grace" => {
                let secs: f64 = parse_number(&flag, &value)?;
                spec.kill_grace = Duration::try_from_secs_f64(secs).map_err(|_| {
                    format!("{flag}: expected a non-negative number of seconds, got {value:?}")
                })?;
            }
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    spec.program = program.ok_or("no program given (put it after --)")?;
    if spec.program.is_empty() {
        return Err("no program given (put it after --)".into());
    }
    spec.args = args.collect();
    // The layout's own checks (node rank below the node count, the world
    // size within bounds): a usage error too, before anything starts.
    spec.validate().map_err(|e| e.to_string())?;
    Ok(Parsed::Run(spec))
}

fn main() -> ExitCode {
    let spec = match parse_args(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(spec)) => spec,
        Ok(Parsed::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("oxccl-run: {e}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match launch(&spec) {
        Ok(report) => ExitCode::from(report.exit_code().clamp(0, 255) as u8),
        Err(e) => {
            // Launch errors already name the launcher in their context.
            let msg = e.to_string();
            if msg.starts_with("oxccl-run:") {
                eprintln!("{msg}");
            } else {
                eprintln!("oxccl-run: {msg}");
            }
            ExitCode::from(1)
        }
    }
}
