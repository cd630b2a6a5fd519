//! Our own thin NCCL FFI, loaded at run time with `libloading`.
//!
//! Why not cudarc's: its loader never tries `libnccl.so.2` — the only name
//! that pip's `nvidia-nccl-cu12/13` and Debian's `libnccl2` install — and it
//! panics when the library is missing. This one tries, in order,
//! `OXCCL_NCCL_LIBRARY` (alone, when set: a path the user named must not be
//! silently replaced by another library), `libnccl.so.2`, `libnccl.so`; it
//! reads the version, refuses versions older than [`MIN_VERSION`], and
//! returns an error listing every name it tried and why each failed.
//!
//! Only what oxccl calls is declared. Every function returns `ncclResult_t`,
//! kept here as a plain `c_int` so that a code newer than this file (NCCL adds
//! them) is a value, not undefined behaviour.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use crate::error::{Error, Result};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclInProgress`: a non-blocking communicator is still working.
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// `ncclComm_t`: an opaque pointer.
pub type RawComm = *mut c_void;
/// `cudaStream_t` (the same handle as the driver's `CUstream`).
pub type RawStream = *mut c_void;
/// `ncclDataType_t`.
pub type NcclDataType = c_int;
/// `ncclRedOp_t`.
pub type NcclRedOp = c_int;

/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct RawUniqueId {
    /// Opaque bytes made by rank 0 and copied to every rank.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `NCCL_CONFIG_UNDEF_INT` (`INT_MIN`): "let NCCL choose".
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `NCCL_API_MAGIC`.
const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// `ncclConfig_t` as NCCL 2.17 defined it.
///
/// NCCL versions the struct: it copies `size` bytes, checks `magic`, and
/// resets every field newer than `version` to its default, so this prefix
/// stays valid on every later NCCL (checked against `init.cc`'s
/// `parseCommConfig`), and on 2.14–2.16 the fields they lack are ignored.
#[repr(C)]
pub struct RawConfig {
    size: usize,
    magic: u32,
    version: u32,
    /// 0: calls return `ncclInProgress` instead of blocking.
    pub blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl RawConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every call returns at
    /// once and we poll `ncclCommGetAsyncError` with our own deadline.
    pub fn non_blocking() -> RawConfig {
        RawConfig {
            size: std::mem::size_of::<RawConfig>(),
            magic: CONFIG_MAGIC,
            version: 21700,
            blocking: 0,
            cga_cluster_size: CONFIG_UNDEF_INT,
            min_ctas: CONFIG_UNDEF_INT,
            max_ctas: CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: CONFIG_UNDEF_INT,
        }
    }
}

/// The oldest NCCL oxccl accepts: 2.14, the first with `ncclConfig_t`
/// (non-blocking initialisation, which our deadlines need). Avg and bf16
/// (2.10) come with it; split needs 2.18 and says so when older.
pub const MIN_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 14,
    patch: 0,
};

/// The first NCCL with `ncclCommSplit`.
pub const SPLIT_VERSION: NcclVersion = NcclVersion {
    major: 2,
    minor: 18,
    patch: 0,
};

/// An NCCL version, decoded from `ncclGetVersion`'s integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major version (2).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `NCCL_VERSION_CODE`: `X*1000 + Y*100 + Z` up to 2.8,
    /// `X*10000 + Y*100 + Z` from 2.9 on (NCCL's `NCCL_VERSION` macro).
    pub fn from_code(code: i32) -> NcclVersion {
        let code = code.max(0) as u32;
        if code < 10_000 {
            NcclVersion {
                major: code / 1000,
                minor: code % 1000 / 100,
                patch: code % 100,
            }
        } else {
            NcclVersion {
                major: code / 10_000,
                minor: code % 10_000 / 100,
                patch: code % 100,
            }
        }
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// The names `ncclResult_t` codes have in `nccl.h`.
pub fn result_name(code: NcclResult) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

macro_rules! nccl_api {
    (required { $( $(#[$doc:meta])* $field:ident = $symbol:literal : fn($($arg:ty),*) $(-> $ret:ty)?; )* }
     optional { $( $(#[$odoc:meta])* $ofield:ident = $osymbol:literal : fn($($oarg:ty),*) $(-> $oret:ty)?; )* }) => {
        /// A loaded NCCL: its path, its version and the entry points oxccl uses.
        pub struct NcclLibrary {
            /// Keeps the entry points valid.
            _library: libloading::Library,
            /// The name or path it was loaded from.
            pub path: String,
            /// Its version (`ncclGetVersion`).
            pub version: NcclVersion,
            $( $(#[$doc])* pub $field: unsafe extern "C" fn($($arg),*) $(-> $ret)?, )*
            $( $(#[$odoc])* pub $ofield: Option<unsafe extern "C" fn($($oarg),*) $(-> $oret)?>, )*
        }

        impl NcclLibrary {
            /// Resolves every entry point of `library`, which was loaded from
            /// `path` and reported `version` ([`version_of`]).
            fn resolve(library: libloading::Library, path: String, version: NcclVersion) -> std::result::Result<NcclLibrary, String> {
                // SAFETY: each symbol is declared with the signature nccl.h
                // gives it; the pointers stay valid while `_library` lives,
                // which is as long as the struct holding them.
                unsafe {
                    $( let $field = *library
                        .get::<unsafe extern "C" fn($($arg),*) $(-> $ret)?>(concat!($symbol, "\0").as_bytes())
                        .map_err(|e| format!("{path}: no symbol {}: {}", $symbol, error_chain(&e)))?; )*
                    $( let $ofield = library
                        .get::<unsafe extern "C" fn($($oarg),*) $(-> $oret)?>(concat!($osymbol, "\0").as_bytes())
                        .ok()
                        .map(|s| *s); )*
                    Ok(NcclLibrary {
                        _library: library,
                        path,
                        version,
                        $( $field, )*
                        $( $ofield, )*
                    })
                }
            }
        }
    };
}

nccl_api! {
  required {
    // `ncclGetVersion(int*)` is read first, on its own: see `version_of`.
    /// `ncclGetErrorString(ncclResult_t)`.
    get_error_string = "ncclGetErrorString": fn(NcclResult) -> *const c_char;
    /// `ncclGetLastError(ncclComm_t)`: the last error's detail, for this thread.
    get_last_error = "ncclGetLastError": fn(RawComm) -> *const c_char;
    /// `ncclGetUniqueId(ncclUniqueId*)`.
    get_unique_id = "ncclGetUniqueId": fn(*mut RawUniqueId) -> NcclResult;
    /// `ncclCommInitRankConfig(comm*, nranks, id, rank, config*)`.
    comm_init_rank_config = "ncclCommInitRankConfig": fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut RawConfig) -> NcclResult;
    /// `ncclCommGetAsyncError(comm, ncclResult_t*)`.
    comm_get_async_error = "ncclCommGetAsyncError": fn(RawComm, *mut NcclResult) -> NcclResult;
    /// `ncclCommFinalize(comm)`.
    comm_finalize = "ncclCommFinalize": fn(RawComm) -> NcclResult;
    /// `ncclCommDestroy(comm)`.
    comm_destroy = "ncclCommDestroy": fn(RawComm) -> NcclResult;
    /// `ncclCommAbort(comm)`.
    comm_abort = "ncclCommAbort": fn(RawComm) -> NcclResult;
    /// `ncclCommCount(comm, int*)`.
    comm_count = "ncclCommCount": fn(RawComm, *mut c_int) -> NcclResult;
    /// `ncclCommUserRank(comm, int*)`.
    comm_user_rank = "ncclCommUserRank": fn(RawComm, *mut c_int) -> NcclResult;
    /// `ncclAllReduce(send, recv, count, dtype, op, comm, stream)`.
    all_reduce = "ncclAllReduce": fn(*const c_void, *mut c_void, usize, NcclDataType, NcclRedOp, RawComm, RawStream) -> NcclResult;
    /// `ncclReduceScatter(send, recv, recvcount, dtype, op, comm, stream)`.
    reduce_scatter = "ncclReduceScatter": fn(*const c_void, *mut c_void, usize, NcclDataType, NcclRedOp, RawComm, RawStream) -> NcclResult;
    /// `ncclAllGather(send, recv, sendcount, dtype, comm, stream)`.
    all_gather = "ncclAllGather": fn(*const c_void, *mut c_void, usize, NcclDataType, RawComm, RawStream) -> NcclResult;
    /// `ncclBroadcast(send, recv, count, dtype, root, comm, stream)`.
    broadcast = "ncclBroadcast": fn(*const c_void, *mut c_void, usize, NcclDataType, c_int, RawComm, RawStream) -> NcclResult;
    /// `ncclReduce(send, recv, count, dtype, op, root, comm, stream)`.
    reduce = "ncclReduce": fn(*const c_void, *mut c_void, usize, NcclDataType, NcclRedOp, c_int, RawComm, RawStream) -> NcclResult;
    /// `ncclSend(send, count, dtype, peer, comm, stream)`.
    send = "ncclSend": fn(*const c_void, usize, NcclDataType, c_int, RawComm, RawStream) -> NcclResult;
    /// `ncclRecv(recv, count, dtype, peer, comm, stream)`.
    recv = "ncclRecv": fn(*mut c_void, usize, NcclDataType, c_int, RawComm, RawStream) -> NcclResult;
    /// `ncclGroupStart()`.
    group_start = "ncclGroupStart": fn() -> NcclResult;
    /// `ncclGroupEnd()`.
    group_end = "ncclGroupEnd": fn() -> NcclResult;
  }
  optional {
    /// `ncclCommSplit(comm, color, key, newcomm*, config*)`, NCCL ≥ 2.18.
    comm_split = "ncclCommSplit": fn(RawComm, c_int, c_int, *mut RawComm, *mut RawConfig) -> NcclResult;
  }
}

impl NcclLibrary {
    /// `ncclGetErrorString(code)` as owned text.
    pub fn error_string(&self, code: NcclResult) -> String {
        // SAFETY: NCCL returns a static C string (or null for codes it does not know).
        unsafe { c_text((self.get_error_string)(code)) }
    }

    /// `ncclGetLastError(comm)` as owned text; may be empty.
    pub fn last_error(&self, comm: RawComm) -> String {
        // SAFETY: NCCL returns a thread-local C string that stays valid until
        // the next NCCL call on this thread; it is copied at once.
        unsafe { c_text((self.get_last_error)(comm)) }
    }
}

/// Copies a C string that may be null.
///
/// # Safety
/// `text` is null or points to a NUL-terminated string.
unsafe fn c_text(text: *const c_char) -> String {
    if text.is_null() {
        String::new()
    } else {
        // SAFETY: non-null and NUL-terminated by the caller's contract.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .trim()
            .to_owned()
    }
}

/// The variable that names the NCCL library to load, as a path or a name.
pub const LIBRARY_VARIABLE: &str = "OXCCL_NCCL_LIBRARY";

/// The names tried, in order: `OXCCL_NCCL_LIBRARY` alone when it is set,
/// otherwise the SONAME every NCCL install provides, then the development
/// symlink.
pub fn candidates() -> Vec<String> {
    match std::env::var(LIBRARY_VARIABLE) {
        Ok(path) if !path.trim().is_empty() => vec![path.trim().to_owned()],
        _ => vec!["libnccl.so.2".to_owned(), "libnccl.so".to_owned()],
    }
}

/// How to get an NCCL the loader finds: the text every "not found" error ends with.
pub const INSTALL_HINT: &str = "install NCCL (`pip install nvidia-nccl-cu12` puts it in \
<site-packages>/nvidia/nccl/lib/libnccl.so.2; Debian/Ubuntu: `apt install libnccl2`) and set \
OXCCL_NCCL_LIBRARY to the library's path, or add its directory to LD_LIBRARY_PATH";

/// An error and its sources in one line: libloading's `dlopen failed` keeps
/// the loader's reason (`cannot open shared object file`, `wrong ELF class`)
/// in its source.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// `ncclGetVersion` of a library just opened from `path`.
fn version_of(
    library: &libloading::Library,
    path: &str,
) -> std::result::Result<NcclVersion, String> {
    // SAFETY: declared as nccl.h declares it; called while `library` lives.
    unsafe {
        let get_version = library
            .get::<unsafe extern "C" fn(*mut c_int) -> NcclResult>(b"ncclGetVersion\0")
            .map_err(|e| format!("{path}: no symbol ncclGetVersion: {}", error_chain(&e)))?;
        let mut code: c_int = 0;
        let rc = get_version(&mut code);
        if rc != NCCL_SUCCESS {
            return Err(format!(
                "{path}: ncclGetVersion returned {}",
                result_name(rc)
            ));
        }
        Ok(NcclVersion::from_code(code))
    }
}

/// Loads the first of `candidates` that opens and resolves, and checks its version.
///
/// # Errors
///
/// [`Error::LibraryNotFound`] listing each candidate and why it failed;
/// [`Error::LibraryUnsupported`] when the one that loaded is older than
/// [`MIN_VERSION`].
pub fn load_from(candidates: &[String]) -> Result<NcclLibrary> {
    let mut tried = Vec::new();
    for path in candidates {
        // SAFETY: loading NCCL runs its ELF initialisers, which only set up
        // NCCL's own state; NCCL is designed to be dlopen'ed (PyTorch does).
        let library = match unsafe { libloading::Library::new(path) } {
            Ok(library) => library,
            Err(e) => {
                tried.push(format!("{path} ({})", error_chain(&e)));
                continue;
            }
        };
        // The version first: an NCCL too old to have every entry point
        // (ncclGetLastError came in 2.13, ncclCommInitRankConfig and
        // ncclCommFinalize in 2.14) is told as too old, not as "not NCCL".
        let version = match version_of(&library, path) {
            Ok(version) => version,
            Err(e) => {
                tried.push(e);
                continue;
            }
        };
        if version < MIN_VERSION {
            return Err(Error::LibraryUnsupported {
                library: "NCCL",
                detail: format!(
                    "{path} is NCCL {version}; oxccl needs NCCL {MIN_VERSION} or newer \
                     (non-blocking initialisation with ncclConfig_t); {INSTALL_HINT}"
                ),
            });
        }
        match NcclLibrary::resolve(library, path.clone(), version) {
            Ok(library) => return Ok(library),
            Err(e) => tried.push(e),
        }
    }
    Err(Error::LibraryNotFound {
        library: "NCCL",
        tried,
        hint: INSTALL_HINT.to_owned(),
    })
}

/// The process's NCCL, loaded on first use from [`candidates`] and kept for
/// the life of the process (NCCL cannot be unloaded while communicators
/// exist). A failed load is not remembered: a later call tries again, so a
/// program may fix `OXCCL_NCCL_LIBRARY` and retry.
///
/// # Errors
///
/// As [`load_from`].
pub fn library() -> Result<&'static NcclLibrary> {
    static LIBRARY: OnceLock<NcclLibrary> = OnceLock::new();
    if let Some(library) = LIBRARY.get() {
        return Ok(library);
    }
    let loaded = load_from(&candidates())?;
    // Two threads may both load; the loser's handle is dropped (dlclose only
    // lowers the reference count of a library that stays loaded).
    Ok(LIBRARY.get_or_init(|| loaded))
}
