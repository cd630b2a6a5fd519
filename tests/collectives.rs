//! Every collective over world sizes {1,2,3,4,5,8}, counts {0, 1, N-1, N+1,
//! 10_007}, in place and out of place, a tiny and the default chunk size,
//! every dtype and op, against closed-form expectations (`oxccl::check`).

mod common;

use std::time::Duration;

use common::run_ranks_with;
use oxccl::check::{count_wrong_input, count_wrong_reduced, fill};
use oxccl::{bf16, f16, Communicator, Element, ReduceOp, Result};

const WORLDS: [usize; 6] = [1, 2, 3, 4, 5, 8];

fn counts(world: usize) -> Vec<usize> {
    let mut c = vec![0, 1, world.saturating_sub(1), world + 1, 10_007];
    c.dedup();
    c
}

fn fail(what: String) -> oxccl::Error {
    oxccl::Error::Config {
        name: "test".into(),
        value: String::new(),
        reason: what,
    }
}

fn ensure(wrong: usize, what: impl FnOnce() -> String) -> Result<()> {
    if wrong == 0 {
        Ok(())
    } else {
        Err(fail(format!("{wrong} wrong elements: {}", what())))
    }
}

/// Runs every collective for one dtype on one communicator.
fn all_collectives<T: Element>(comm: &mut Communicator) -> Result<()> {
    let (rank, world) = (comm.rank(), comm.world_size());
    for count in counts(world) {
        for op in ReduceOp::ALL {
            let ctx = || format!("{} {op} count {count} world {world}", T::DTYPE);
            // all_reduce
            let mut send = vec![T::zeroed(); count];
            fill(&mut send, rank, 0, op);
            let mut recv = vec![T::zeroed(); count];
            comm.all_reduce(&send, &mut recv, op)?;
            ensure(count_wrong_reduced(&recv, world, 0, op), || {
                format!("all_reduce {}", ctx())
            })?;
            let mut buf = send.clone();
            comm.all_reduce_in_place(&mut buf, op)?;
            ensure(count_wrong_reduced(&buf, world, 0, op), || {
                format!("all_reduce in place {}", ctx())
            })?;

            // reduce_scatter: `count` per rank
            let mut full = vec![T::zeroed(); count * world];
            fill(&mut full, rank, 0, op);
            let mut part = vec![T::zeroed(); count];
            comm.reduce_scatter(&full, &mut part, op)?;
            ensure(count_wrong_reduced(&part, world, rank * count, op), || {
                format!("reduce_scatter {}", ctx())
            })?;
            comm.reduce_scatter_in_place(&mut full, op)?;
            let mine = &full[rank * count..(rank + 1) * count];
            ensure(count_wrong_reduced(mine, world, rank * count, op), || {
                format!("reduce_scatter in place {}", ctx())
            })?;

            // reduce to every root
            for root in [0, world - 1] {
                let mut recv = vec![T::zeroed(); if rank == root { count } else { 0 }];
                comm.reduce(&send, &mut recv, op, root)?;
                ensure(count_wrong_reduced(&recv, world, 0, op), || {
                    format!("reduce root {root} {}", ctx())
                })?;
                let mut buf = send.clone();
                comm.reduce_in_place(&mut buf, op, root)?;
                let wrong = if rank == root {
                    count_wrong_reduced(&buf, world, 0, op)
                } else {
                    count_wrong_input(&buf, rank, 0, op)
                };
                ensure(wrong, || format!("reduce in place root {root} {}", ctx()))?;
            }
        }
        let op = ReduceOp::Sum;
        // all_gather: rank r contributes its inputs for indices r*count..
        let mut mine = vec![T::zeroed(); count];
        fill(&mut mine, 0, rank * count, op);
        let mut gathered = vec![T::zeroed(); count * world];
        comm.all_gather(&mine, &mut gathered)?;
        ensure(count_wrong_input(&gathered, 0, 0, op), || {
            format!("all_gather count {count}")
        })?;
        let mut buf = vec![T::zeroed(); count * world];
        buf[rank * count..(rank + 1) * count].copy_from_slice(&mine);
        comm.all_gather_in_place(&mut buf)?;
        ensure(count_wrong_input(&buf, 0, 0, op), || {
            format!("all_gather in place count {count}")
        })?;

        // broadcast from every root
        for root in 0..world {
            let mut src = vec![T::zeroed(); count];
            fill(&mut src, root, 0, op);
            let mut recv = vec![T::zeroed(); count];
            let send: &[T] = if rank == root { &src } else { &[] };
            comm.broadcast(send, &mut recv, root)?;
            ensure(count_wrong_input(&recv, root, 0, op), || {
                format!("broadcast root {root} count {count}")
            })?;
            let mut buf = if rank == root {
                src.clone()
            } else {
                vec![T::zeroed(); count]
            };
            comm.broadcast_in_place(&mut buf, root)?;
            ensure(count_wrong_input(&buf, root, 0, op), || {
                format!("broadcast in place root {root}")
            })?;
        }

        // all_to_all: block p of rank r's input is rank r's inputs at p*count..
        let mut send = vec![T::zeroed(); count * world];
        fill(&mut send, rank, 0, op);
        let mut recv = vec![T::zeroed(); count * world];
        comm.all_to_all(&send, &mut recv)?;
        for from in 0..world {
            let block = &recv[from * count..(from + 1) * count];
            let mut expected = vec![T::zeroed(); count];
            fill(&mut expected, from, rank * count, op);
            ensure(usize::from(block != expected.as_slice()), || {
                format!("all_to_all from {from} count {count}")
            })?;
        }
        comm.barrier()?;
    }
    Ok(())
}

fn every_dtype(comm: &mut Communicator) -> Result<()> {
    all_collectives::<f32>(comm)?;
    all_collectives::<f64>(comm)?;
    all_collectives::<f16>(comm)?;
    all_collectives::<bf16>(comm)?;
    all_collectives::<i8>(comm)?;
    all_collectives::<u8>(comm)?;
    all_collectives::<i32>(comm)?;
    all_collectives::<u32>(comm)?;
    all_collectives::<i64>(comm)?;
    all_collectives::<u64>(comm)
}

fn matrix(chunk_bytes: usize) {
    for world in WORLDS {
        let builder = Communicator::builder()
            .timeout(Duration::from_secs(30))
            .chunk_bytes(chunk_bytes);
        run_ranks_with(world, builder, every_dtype)
            .unwrap_or_else(|e| panic!("world {world}: {e}"));
    }
}

#[test]
fn every_collective_default_chunks() {
    matrix(oxccl::DEFAULT_CHUNK_BYTES);
}

/// 64-byte pieces force thousands of pipeline steps (Gloo's
/// `setMaxSegmentSize(128)` trick).
#[test]
fn every_collective_tiny_chunks() {
    matrix(64);
}

#[test]
fn one_byte_chunks_still_move_whole_elements() {
    let builder = Communicator::builder().chunk_bytes(1);
    run_ranks_with(3, builder, |comm| {
        let mut v = vec![comm.rank() as u64 + 1; 10];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        ensure(v.iter().filter(|&&x| x != 6).count(), || "sum".into())
    })
    .unwrap();
}
