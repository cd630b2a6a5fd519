//! The CPUs a process may run on, as words of bits: what tells whether the
//! ranks of one host outnumber its CPUs ("crowded"), where a waiting rank
//! should give its core to the peer it waits for rather than spin.

/// Words of [`affinity_words`]: 1024 CPUs, `cpu_set_t`'s capacity.
pub(crate) const AFFINITY_WORDS: usize = 16;

/// CPUs as bits, `AFFINITY_WORDS` words of 64.
pub(crate) type CpuWords = [u64; AFFINITY_WORDS];

/// The CPUs this thread may run on (`sched_getaffinity`), one bit each;
/// every bit set when it cannot be read (then nothing looks crowded).
pub(crate) fn affinity_words() -> CpuWords {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most
    // its size.
    let (rc, set) = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        let rc = libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set);
        (rc, set)
    };
    if rc != 0 {
        return [u64::MAX; AFFINITY_WORDS];
    }
    let mut words = [0u64; AFFINITY_WORDS];
    for cpu in 0..AFFINITY_WORDS * 64 {
        // SAFETY: `cpu` is below cpu_set_t's capacity (1024).
        if unsafe { libc::CPU_ISSET(cpu, &set) } {
            words[cpu / 64] |= 1 << (cpu % 64);
        }
    }
    words
}

/// How many CPUs the union of `sets` holds: the CPUs a group of ranks may
/// run on together (a rank pinned to one core sees one CPU, whatever the
/// others have).
pub(crate) fn union_count<'a>(sets: impl IntoIterator<Item = &'a CpuWords>) -> usize {
    let union = sets
        .into_iter()
        .fold([0u64; AFFINITY_WORDS], |mut union, set| {
            for (u, w) in union.iter_mut().zip(set) {
                *u |= w;
            }
            union
        });
    union.iter().map(|w| w.count_ones() as usize).sum()
}

/// Whether `threads` threads outnumber the CPUs the calling thread may run
/// on (its affinity, read now: before the threads pin themselves): what
/// `local_group` decides once, for its threads' arena and
/// `Communicator::ranks_outnumber_cpus`.
pub(crate) fn threads_outnumber_cpus(threads: usize) -> bool {
    threads > union_count([&affinity_words()])
}

/// `words` as text for a rendezvous entry: hexadecimal words separated by
/// commas, trailing empty words left out (`"3"` for CPUs 0 and 1).
pub(crate) fn to_field(words: &CpuWords) -> String {
    let used = words
        .iter()
        .rposition(|&w| w != 0)
        .map_or(1, |last| last + 1);
    words[..used]
        .iter()
        .map(|w| format!("{w:x}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The words [`to_field`] wrote, or `None` for text it cannot have written.
pub(crate) fn from_field(text: &str) -> Option<CpuWords> {
    let mut words = [0u64; AFFINITY_WORDS];
    let mut parts = text.split(',');
    for word in &mut words {
        match parts.next() {
            Some(part) => *word = u64::from_str_radix(part, 16).ok()?,
            None => return Some(words),
        }
    }
    parts.next().is_none().then_some(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_sets_go_through_a_field_and_unite() {
        let mut pinned = [0u64; AFFINITY_WORDS];
        pinned[0] = 0b10;
        let mut far = [0u64; AFFINITY_WORDS];
        far[0] = 0b11;
        far[15] = 1 << 63;
        for set in [pinned, far, [u64::MAX; AFFINITY_WORDS], affinity_words()] {
            assert_eq!(from_field(&to_field(&set)), Some(set));
        }
        assert_eq!(to_field(&pinned), "2");
        assert_eq!(from_field(&to_field(&[0; AFFINITY_WORDS])), Some([0; 16]));
        for bad in ["", "x", "1,,2", "-1", &["1"; 17].join(",")] {
            assert_eq!(from_field(bad), None, "{bad:?}");
        }
        assert_eq!(union_count([&pinned, &pinned]), 1);
        assert_eq!(union_count([&pinned, &far]), 3);
        assert_eq!(union_count([]), 0);
        assert!(union_count([&affinity_words()]) >= 1);
    }
}
