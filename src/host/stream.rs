//! Copies into a caller's buffer: writes that bypass the cache
//! (non-temporal stores), for outputs too large to stay in cache, and
//! cached copies that stay fast whatever the two buffers' offsets within a
//! cache line ([`copy_cached`]).
//!
//! An ordinary store to a line that is not in cache first reads the line
//! from memory (a *read for ownership*), so writing a large output costs a
//! read and a write per byte. Non-temporal stores skip that read and do not
//! evict the working set. Measured on the 2-vCPU VM of `docs/performance.md`
//! with `../shared/anchors/membw.c` (one core, 64 MiB arrays, bytes read +
//! written counted): copy 12.7 GB/s, glibc `memcpy` 13.0, non-temporal copy
//! 17.1; `a = b + c` 14.2, non-temporal 19.1. glibc's `memcpy` would switch
//! to such stores only above three quarters of the last-level cache, which
//! a VM may report as hundreds of MiB.
//!
//! Non-temporal stores are weakly ordered: every writing function here ends
//! with a store fence, except `copy_streaming_unfenced`, whose callers run
//! [`fence`] once after a series of copies; so the release store that
//! publishes the data afterwards (a slot header, a `done` word) still
//! orders it for the readers.

/// Outputs of at least this many bytes are written with non-temporal stores
/// (the largest buffer of the call). Below it the output usually still fits
/// in the caches, where the caller will read it next.
pub(crate) const STREAM_MIN_BYTES: usize = 16 << 20;

/// From which output size (bytes) an out-of-place all-gather copies its own
/// part with non-temporal stores, on this CPU. Below [`STREAM_MIN_BYTES`]
/// the answer depends on the cache hierarchy, so it is a measured table
/// keyed by the CPU's vendor, as NCCL keys its own tuning:
///
/// - Intel (the VM of stop 17: 2 MiB L2 per core): from 1 MiB. The
///   footprint is then about twice the output (output, own input, the
///   peers' inputs pulled through the cache), past the L2, and the copy's
///   ordinary stores evicted the lines the pulls still needed. 2 processes
///   over shared memory, 4 alternating runs of 300 iterations: 1 MiB 75–86
///   → 50–69 µs, 2 MiB 209–220 → 189–201 µs, 4 MiB 446–500 → 430–440 µs;
///   512 KiB would lose (10 → 16 µs at 256 KiB).
/// - AMD (Zen 4 VM of stop 19: 1 MiB L2 per core, 32 MiB L3 shared by
///   both vCPUs): only from [`STREAM_MIN_BYTES`]. Under 16 MiB the output
///   stays in the shared L3, and streaming it to memory cost 15–30 %:
///   2 processes, 3 alternating runs of 100 iterations, medians of each,
///   1 MiB 62–71 → 52–53 µs and 4 MiB 243–294 → 205–213 µs, and with the
///   caller reading its whole output after each call 83–99 → 66–67 µs
///   and 331–396 → 264–268 µs.
pub(crate) fn own_part_stream_min_bytes() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        if cpu_vendor_is_amd() {
            STREAM_MIN_BYTES
        } else {
            1 << 20
        }
    })
}

/// Whether the CPU reports an AMD (or Hygon, its Zen licensee) vendor id.
/// Asked once: `cpuid` exits to the hypervisor in a VM.
pub(crate) fn cpu_vendor_is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(read_cpu_vendor_is_amd)
}

fn read_cpu_vendor_is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
        #[allow(unused_unsafe)]
        let id = unsafe { std::arch::x86_64::__cpuid(0) };
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&id.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&id.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&id.ecx.to_le_bytes());
        &vendor == b"AuthenticAMD" || &vendor == b"HygonGenuine"
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has PREFETCHW (CPUID 8000_0001h, ECX bit 8: AMD since
/// the K6, Intel since Broadwell). Asked once, as the vendor is.
pub(crate) fn cpu_has_prefetchw() -> bool {
    static PREFETCHW: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PREFETCHW.get_or_init(read_cpu_has_prefetchw)
}

fn read_cpu_has_prefetchw() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // SAFETY: CPUID exists on every x86-64 CPU; leaf 8000_0000h gives
        // the highest extended leaf, so 8000_0001h is only asked where it
        // exists. (`__cpuid` is a safe function from Rust 1.94 on.)
        #[allow(unused_unsafe)]
        unsafe {
            __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Bytes of the cache-resident block that [`fold_streaming`] computes into
/// before streaming it out: within L1 beside the operands' lines.
const BOUNCE_BYTES: usize = 8192;

/// Copies `len` elements from `src` to `dst` with non-temporal stores and a
/// store fence.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: both ranges valid, not overlapping.
pub(crate) unsafe fn copy_streaming<T: Copy>(src: *const T, dst: *mut T, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_streaming_unfenced(src, dst, len) };
    fence();
}

/// [`copy_streaming`] without the fence: a series of copies fenced once at
/// its end with [`fence`] (a fence drains the write-combining buffers, so
/// one per small block costs bandwidth).
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`; and [`fence`] must run before the
/// data is published to another thread.
pub(crate) unsafe fn copy_streaming_unfenced<T: Copy>(src: *const T, dst: *mut T, len: usize) {
    let bytes = len * std::mem::size_of::<T>();
    // SAFETY: the caller's contract, in bytes.
    unsafe { copy_bytes_streaming(src.cast(), dst.cast(), bytes) }
}

/// Orders every non-temporal store before it ahead of later stores.
pub(crate) fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
    #[cfg(not(target_arch = "x86_64"))]
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
}

/// # Safety
/// `src` valid for reads and `dst` for writes of `bytes`, not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_bytes_streaming(src: *const u8, dst: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_by_lines::<true>(src, dst, bytes) }
}

/// Copies `bytes` from `src` to `dst` 64 bytes per step: four unaligned
/// 16-byte loads, four aligned stores — non-temporal when `STREAM` (the
/// destination aligned to 16 bytes first), ordinary ones otherwise (to a
/// whole cache line: the destination aligned to 64). `memcpy` takes the
/// unaligned head and the tail.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `bytes`, not overlapping.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn copy_by_lines<const STREAM: bool>(src: *const u8, dst: *mut u8, bytes: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_store_si128, _mm_stream_si128};
    let head = dst.align_offset(if STREAM { 16 } else { 64 }).min(bytes);
    // SAFETY: within both ranges (head ≤ bytes).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let body = (bytes - head) / 64 * 64;
    let mut at = head;
    while at < head + body {
        // SAFETY: `at + 64 ≤ bytes`; `dst + at` is aligned for the stores
        // (SSE2 is part of x86_64, so the intrinsics are always available).
        unsafe {
            let s = src.add(at) as *const __m128i;
            let d = dst.add(at) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            if STREAM {
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            } else {
                _mm_store_si128(d, a);
                _mm_store_si128(d.add(1), b);
                _mm_store_si128(d.add(2), c);
                _mm_store_si128(d.add(3), e);
            }
        }
        at += 64;
    }
    // SAFETY: the tail lies within both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), bytes - at) };
}

/// Copies `len` elements from `src` to `dst` through the cache (ordinary
/// stores), fast whatever the two addresses' offsets within a cache line.
///
/// glibc's `memcpy` (`rep movsb` at these sizes) loses a third of its speed
/// here when the source and destination sit at different offsets within
/// their cache lines, as a slot (line-aligned) and a caller's buffer do
/// when the buffer is not: a `Vec<f32>` of a few MiB comes from `mmap`
/// 16 bytes past a page boundary. Such copies store whole aligned lines
/// from unaligned loads instead; copies whose two ends share their offset,
/// and small ones, stay with `memcpy`. Measured on the Zen 4 VM of
/// `docs/performance.md` (near placement, cached slot stores), two
/// processes, all-gather on buffers 16 bytes past a line, as the ratio
/// to Open MPI's in the same processes (`examples/mpi_side_by_side.rs`,
/// five alternating rounds): 1 MiB 1.21–1.24 → 1.37–1.55, 16 MiB 1.13–1.25
/// → 1.43–1.74, 64 MiB 0.98–1.37 → 1.57–1.85; on line-aligned buffers
/// the same build read 1.41–1.48, 1.43–1.64 and 1.68–1.78.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`.
pub(crate) unsafe fn copy_cached<T: Copy>(src: *const T, dst: *mut T, len: usize) {
    let bytes = len * std::mem::size_of::<T>();
    // `copy_nonoverlapping`'s own debug check would only see the head and
    // the tail of a copy that takes the loop below.
    debug_assert!(
        (src as usize) + bytes <= dst as usize || (dst as usize) + bytes <= src as usize,
        "copy_cached: overlapping ranges"
    );
    // SAFETY: the caller's contract, in bytes.
    unsafe { copy_bytes_cached(src.cast(), dst.cast(), bytes) }
}

/// # Safety
/// `src` valid for reads and `dst` for writes of `bytes`, not overlapping.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_bytes_cached(src: *const u8, dst: *mut u8, bytes: usize) {
    if bytes < 4096 || (src as usize).wrapping_sub(dst as usize).is_multiple_of(64) {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
    } else {
        // SAFETY: the caller's contract.
        unsafe { copy_by_lines::<false>(src, dst, bytes) };
    }
}

/// # Safety
/// As above.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_bytes_cached(src: *const u8, dst: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
}

/// # Safety
/// As above.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_bytes_streaming(src: *const u8, dst: *mut u8, bytes: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, bytes) };
}

/// Writes `out` block by block: `compute(block, offset)` fills a
/// cache-resident block with elements `offset..offset + block.len()` of the
/// result, which is then streamed into `out`. Reductions whose result goes
/// to a large output use it, so the result is written once, without the
/// output's lines ever being read.
pub(crate) fn fold_streaming<T: bytemuck::Pod>(
    out: &mut [T],
    compute: impl FnMut(&mut [T], usize),
) {
    in_blocks(out.len(), compute, |block, at| {
        // SAFETY: `block` and `out[at..at + n]` are distinct and in range.
        unsafe { copy_streaming_unfenced(block.as_ptr(), out.as_mut_ptr().add(at), block.len()) };
    });
    fence();
}

/// Computes a result of `len` elements block by block in a cache-resident
/// buffer: `compute(block, offset)` fills `block` with elements
/// `offset..offset + block.len()`, then `sink(block, offset)` stores them
/// wherever they go (one or several places, read from L1).
pub(crate) fn in_blocks<T: bytemuck::Pod>(
    len: usize,
    mut compute: impl FnMut(&mut [T], usize),
    mut sink: impl FnMut(&[T], usize),
) {
    // Every element type divides the block and is at most 8-byte aligned.
    // Line-aligned, so a copy from it into a line-aligned slot or output
    // has both ends on the same offset in a line (see `copy_cached`).
    #[repr(C, align(64))]
    struct Bounce([u64; BOUNCE_BYTES / 8]);
    let mut words = Bounce([0u64; BOUNCE_BYTES / 8]);
    let bounce: &mut [T] = bytemuck::cast_slice_mut(&mut words.0[..]);
    let per = bounce.len();
    let mut at = 0;
    while at < len {
        let n = per.min(len - at);
        let block = &mut bounce[..n];
        compute(block, at);
        sink(block, at);
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_copies_match_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        for skew in 0..17 {
            for len in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 200, 500, 900] {
                let mut dst = vec![0xAAu8; 1000];
                // SAFETY: skew + len ≤ 1000 in both buffers; distinct buffers.
                unsafe { copy_streaming(src.as_ptr().add(3), dst.as_mut_ptr().add(skew), len) };
                assert_eq!(
                    &dst[skew..skew + len],
                    &src[3..3 + len],
                    "skew {skew} len {len}"
                );
                assert!(
                    dst[..skew].iter().all(|&b| b == 0xAA),
                    "wrote before the range"
                );
                assert!(
                    dst[skew + len..].iter().all(|&b| b == 0xAA),
                    "wrote past the range"
                );
            }
        }
    }

    #[test]
    fn cached_copies_match_at_every_alignment_and_length() {
        // Line-aligned bases, so each (source, destination) offset pair is
        // what it says: equal offsets take `memcpy`, the others the
        // aligned-store loop, with every head (0–63 bytes) and tails
        // around it.
        #[repr(C, align(64))]
        struct Lines([u8; 12_288]);
        let mut src = Box::new(Lines([0; 12_288]));
        for (i, b) in src.0.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let mut dst = Box::new(Lines([0; 12_288]));
        for src_skew in [0, 1, 16, 40, 63] {
            for dst_skew in 0..64 {
                for len in [0, 1, 63, 64, 4095, 4096, 4097, 4160, 4200, 8191] {
                    dst.0.fill(0xAA);
                    // SAFETY: skew + len < 12 288 in both buffers, which
                    // are distinct.
                    unsafe {
                        copy_cached(
                            src.0.as_ptr().add(src_skew),
                            dst.0.as_mut_ptr().add(dst_skew),
                            len,
                        )
                    };
                    let what = format!("skews {src_skew}/{dst_skew} len {len}");
                    assert_eq!(
                        &dst.0[dst_skew..dst_skew + len],
                        &src.0[src_skew..src_skew + len],
                        "{what}"
                    );
                    assert!(
                        dst.0[..dst_skew].iter().all(|&b| b == 0xAA),
                        "wrote before: {what}"
                    );
                    assert!(
                        dst.0[dst_skew + len..].iter().all(|&b| b == 0xAA),
                        "wrote past: {what}"
                    );
                }
            }
        }
    }

    #[test]
    fn streamed_folds_cover_every_block() {
        let a: Vec<f32> = (0..5000).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..5000).map(|i| (2 * i) as f32).collect();
        let mut out = vec![0f32; 5000];
        fold_streaming(&mut out, |block, at| {
            for (i, o) in block.iter_mut().enumerate() {
                *o = a[at + i] + b[at + i];
            }
        });
        assert!(out.iter().enumerate().all(|(i, &x)| x == (3 * i) as f32));
    }
}
