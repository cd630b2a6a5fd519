//! The file store: a directory on a file system every rank can see.
//!
//! Each key is one file, named `k_` followed by the key with every byte
//! outside `[A-Za-z0-9._-]` written as `%XX`. A value is written to a
//! temporary file in the same directory and renamed over the key's file, so
//! readers see either nothing or the whole value. [`add`](Store::add) and
//! [`set`](Store::set) hold an exclusive `flock` on the directory's `lock`
//! file around their update, so counters are atomic across processes (Linux
//! maps `flock` on NFS to byte-range locks, which NFS supports).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::memory::parse_counter;
use super::Store;
use crate::error::{Error, Result};

/// How often a wait looks for its files.
const POLL: Duration = Duration::from_millis(10);
/// Longest file name made from a key (file systems allow 255 bytes).
const MAX_NAME: usize = 240;
/// The lock file's name; no key file or temporary file can have it.
const LOCK_NAME: &str = "lock";
/// How long `set` and `add` wait for the lock by default (see
/// [`FileStore::lock_timeout`]).
const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a taken lock is tried again.
const LOCK_RETRY: Duration = Duration::from_millis(1);

/// Distinguishes the temporary files of the threads of one process.
static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A [`Store`] kept in a directory on a shared file system
/// (`OXCCL_STORE=file:/shared/dir`). Use a fresh directory per job: keys
/// left by an earlier job would be seen as already set.
#[derive(Clone, Debug)]
pub struct FileStore {
    dir: PathBuf,
    lock_timeout: Duration,
}

impl FileStore {
    /// A store in `dir`, created (with its parents) if it does not exist.
    ///
    /// # Errors
    ///
    /// [`Error::Bootstrap`] when the directory cannot be created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<FileStore> {
        let dir = dir.into();
        fs::create_dir_all(&dir).map_err(|e| Error::Bootstrap {
            context: format!("creating the file store directory {}", dir.display()),
            detail: e.to_string(),
        })?;
        Ok(FileStore {
            dir,
            lock_timeout: DEFAULT_LOCK_TIMEOUT,
        })
    }

    /// How long [`set`](Store::set) and [`add`](Store::add) wait for the
    /// directory's lock before failing with an error that names it (a
    /// holder stopped with Ctrl-Z or in a debugger, a lock stuck in NFS
    /// recovery); 60 s unless set. Communicators pass their timeout.
    pub fn lock_timeout(mut self, timeout: Duration) -> FileStore {
        self.lock_timeout = timeout;
        self
    }

    /// The directory holding the store.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn error(&self, detail: String) -> Error {
        Error::Bootstrap {
            context: format!("store {}", self.describe()),
            detail,
        }
    }

    fn io_error(&self, what: &str, key: &str, e: io::Error) -> Error {
        self.error(format!("{what} key {key:?}: {e}"))
    }

    fn key_path(&self, key: &str) -> Result<PathBuf> {
        let name = escape_key(key);
        if name.len() > MAX_NAME {
            return Err(self.error(format!(
                "key {key:?} is too long for a file store (at most {MAX_NAME} bytes once escaped)"
            )));
        }
        Ok(self.dir.join(name))
    }

    /// Writes `value` to a fresh temporary file in the directory.
    fn write_temp(&self, key: &str, value: &[u8]) -> Result<PathBuf> {
        let unique = TEMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let tmp = self
            .dir
            .join(format!("t_{}_{unique}_{nanos}", std::process::id()));
        let written = File::create(&tmp).and_then(|mut f| f.write_all(value));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(self.io_error("writing", key, e));
        }
        Ok(tmp)
    }

    fn lock(&self) -> Result<FlockGuard> {
        let path = self.dir.join(LOCK_NAME);
        let start = Instant::now();
        // Threads of this process first take turns among themselves: on
        // NFS `flock` is emulated with POSIX locks, which belong to the
        // process (a second thread would get the lock too) and which any
        // close of the file releases (that thread's guard would drop the
        // first one's lock).
        // Keyed by the directory's canonical path: two stores naming it
        // differently (relative, through a symlink) still take turns.
        let key = fs::canonicalize(&self.dir)
            .unwrap_or_else(|_| self.dir.clone())
            .join(LOCK_NAME);
        let in_process = InProcessTurn::take(&key, self.lock_timeout).ok_or_else(|| {
            self.error(format!(
                "the lock {} was held by another thread of this process for {:?}",
                path.display(),
                self.lock_timeout
            ))
        })?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| self.error(format!("opening the lock file {}: {e}", path.display())))?;
        loop {
            // SAFETY: flock on a descriptor this function owns.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                return Ok(FlockGuard {
                    file,
                    _in_process: in_process,
                });
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock if start.elapsed() < self.lock_timeout => {
                    std::thread::sleep(LOCK_RETRY);
                }
                io::ErrorKind::WouldBlock => {
                    return Err(self.error(format!(
                        "the lock {} was held by another process for {:?} (stopped, or \
                         stuck in NFS lock recovery?)",
                        path.display(),
                        self.lock_timeout
                    )))
                }
                _ => return Err(self.error(format!("locking {}: {e}", path.display()))),
            }
        }
    }
}

/// Holds an exclusive `flock`; released on drop (closing the file would
/// release it too), before this process's other threads get their turn.
struct FlockGuard {
    file: File,
    _in_process: InProcessTurn,
}

/// The lock files a thread of this process holds (or is about to take).
static HELD_IN_PROCESS: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
static RELEASED_IN_PROCESS: std::sync::Condvar = std::sync::Condvar::new();

/// This thread's turn, among this process's threads, at one lock file.
struct InProcessTurn {
    path: PathBuf,
}

impl InProcessTurn {
    /// Waits until no other thread of this process holds `path`, for at
    /// most `timeout`; `None` past it.
    fn take(path: &Path, timeout: Duration) -> Option<InProcessTurn> {
        // A timeout no clock can add (`lock_timeout(Duration::MAX)`): no
        // deadline, as the caller asked.
        let deadline = Instant::now().checked_add(timeout);
        // A poisoned list is still a list: a panic cannot leave it torn.
        let mut held = HELD_IN_PROCESS.lock().unwrap_or_else(|p| p.into_inner());
        while held.iter().any(|h| h == path) {
            held = match deadline {
                Some(deadline) => {
                    let left = deadline.checked_duration_since(Instant::now())?;
                    RELEASED_IN_PROCESS
                        .wait_timeout(held, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => RELEASED_IN_PROCESS
                    .wait(held)
                    .unwrap_or_else(|p| p.into_inner()),
            };
        }
        held.push(path.to_path_buf());
        Some(InProcessTurn {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for InProcessTurn {
    fn drop(&mut self) {
        let mut held = HELD_IN_PROCESS.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(at) = held.iter().position(|h| *h == self.path) {
            held.swap_remove(at);
        }
        RELEASED_IN_PROCESS.notify_all();
    }
}

impl Drop for FlockGuard {
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor this guard owns.
        unsafe {
            libc::flock(self.file.as_raw_fd(), libc::LOCK_UN);
        }
    }
}

/// `k_` then the key, bytes outside `[A-Za-z0-9._-]` as `%XX`.
fn escape_key(key: &str) -> String {
    let mut name = String::with_capacity(key.len() + 2);
    name.push_str("k_");
    for &b in key.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            name.push(b as char);
        } else {
            name.push_str(&format!("%{b:02X}"));
        }
    }
    name
}

fn read_optional(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let path = self.key_path(key)?;
        let tmp = self.write_temp(key, value)?;
        // The lock orders this set with any add of the same key.
        let renamed = self.lock().and_then(|_guard| {
            fs::rename(&tmp, &path).map_err(|e| self.io_error("setting", key, e))
        });
        if renamed.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        renamed
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let path = self.key_path(key)?;
        read_optional(&path).map_err(|e| self.io_error("reading", key, e))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let path = self.key_path(key)?;
        let _guard = self.lock()?;
        let current = match read_optional(&path).map_err(|e| self.io_error("reading", key, e))? {
            None => 0,
            Some(bytes) => parse_counter(&bytes).ok_or_else(|| {
                self.error(format!("key {key:?} holds a value that is not a counter"))
            })?,
        };
        let next = current.wrapping_add(delta);
        let tmp = self.write_temp(key, next.to_string().as_bytes())?;
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(self.io_error("updating", key, e));
        }
        Ok(next)
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let paths = keys
            .iter()
            .map(|k| self.key_path(k))
            .collect::<Result<Vec<_>>>()?;
        let start = Instant::now();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        loop {
            // Only "no such file" is "not set yet": another error (a
            // directory this user may not read) would never go away, and
            // waiting it out would report it as ranks that never came.
            let mut unreadable = None;
            pending.retain(|&i| match fs::metadata(&paths[i]) {
                Ok(_) => false,
                Err(e) if e.kind() == io::ErrorKind::NotFound => true,
                Err(e) => {
                    unreadable.get_or_insert((i, e));
                    true
                }
            });
            if let Some((i, e)) = unreadable {
                return Err(self.io_error("looking for", &keys[i], e));
            }
            let waited = start.elapsed();
            if pending.is_empty() || waited >= timeout {
                return Ok(pending.iter().map(|&i| keys[i].clone()).collect());
            }
            std::thread::sleep(POLL.min(timeout - waited));
        }
    }

    fn describe(&self) -> String {
        format!("file:{}", self.dir.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Threads of one process take turns at a lock file before `flock`
    /// (which NFS emulates per process): a second thread waits for the
    /// first's guard, within the timeout, and gets its turn once it drops.
    #[test]
    fn threads_of_one_process_take_turns_at_a_lock_file() {
        let path = std::env::temp_dir().join(format!("oxccl-turn-{}", std::process::id()));
        let first = InProcessTurn::take(&path, Duration::from_millis(10)).unwrap();
        let waiter = {
            let path = path.clone();
            std::thread::spawn(move || {
                let start = Instant::now();
                let turn = InProcessTurn::take(&path, Duration::from_secs(5));
                (turn.is_some(), start.elapsed())
            })
        };
        let other = path.with_extension("other");
        assert!(InProcessTurn::take(&other, Duration::ZERO).is_some());
        assert!(InProcessTurn::take(&path, Duration::from_millis(50)).is_none());
        std::thread::sleep(Duration::from_millis(100));
        drop(first);
        let (got, waited) = waiter.join().unwrap();
        assert!(got);
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "oxccl-filestore-{name}-{}-{}",
            std::process::id(),
            TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    /// A holder that never lets go (stopped, or a stuck NFS lock) costs
    /// `set` and `add` their lock timeout and an error naming the lock,
    /// not a wait without end.
    #[test]
    fn a_lock_held_elsewhere_is_an_error_after_the_lock_timeout() {
        let dir = temp_dir("held");
        let store = FileStore::new(&dir)
            .unwrap()
            .lock_timeout(Duration::from_millis(200));
        store.set("before", b"x").unwrap();
        let holder = File::open(dir.join(LOCK_NAME)).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(holder.as_raw_fd(), libc::LOCK_EX) }, 0);
        let start = Instant::now();
        let e = store.add("counter", 1).unwrap_err().to_string();
        assert!(e.contains("was held by another process"), "{e}");
        assert!(
            e.contains(&dir.join(LOCK_NAME).display().to_string()),
            "{e}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        assert!(store.set("after", b"y").is_err());
        drop(holder);
        assert_eq!(store.add("counter", 1).unwrap(), 1);
        let _ = fs::remove_dir_all(&dir);
    }

    /// A key that cannot be looked for (here the directory became a file:
    /// ENOTDIR; a directory this user may not read gives EACCES) is an
    /// error at once, not a wait that ends naming the key as never set.
    #[test]
    fn a_wait_that_cannot_look_is_an_error_not_a_timeout() {
        let dir = temp_dir("gone");
        let store = FileStore::new(&dir).unwrap();
        fs::remove_dir_all(&dir).unwrap();
        fs::write(&dir, b"not a directory").unwrap();
        let start = Instant::now();
        let e = store
            .wait(&["oxccl/rank/1".to_string()], Duration::from_secs(5))
            .unwrap_err()
            .to_string();
        assert!(e.contains("looking for key \"oxccl/rank/1\""), "{e}");
        assert!(start.elapsed() < Duration::from_secs(4));
        let _ = fs::remove_file(&dir);
    }

    #[test]
    fn set_get_add_wait() {
        let dir = temp_dir("basic");
        let store = FileStore::new(dir.join("nested")).unwrap();
        assert_eq!(
            store.describe(),
            format!("file:{}", dir.join("nested").display())
        );
        store.set("a", b"1").unwrap();
        assert_eq!(store.try_get("a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(store.try_get("b").unwrap(), None);
        store.set("a", b"replaced").unwrap();
        assert_eq!(store.try_get("a").unwrap(), Some(b"replaced".to_vec()));
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", 3).unwrap(), 5);
        assert_eq!(store.add("n", -6).unwrap(), -1);
        store.set("text", b"x").unwrap();
        assert!(store
            .add("text", 1)
            .unwrap_err()
            .to_string()
            .contains("not a counter"));
        let missing = store
            .wait(&["a".into(), "z".into()], Duration::from_millis(50))
            .unwrap();
        assert_eq!(missing, vec!["z".to_string()]);
        let other = store.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            other.set("late", b"v").unwrap();
        });
        assert_eq!(store.get("late", Duration::from_secs(5)).unwrap(), b"v");
        t.join().unwrap();
        assert!(store.get("never", Duration::from_millis(10)).is_err());
        assert!(store.wait(&["a".into()], Duration::MAX).unwrap().is_empty());

        // Keys with separators and odd bytes stay inside the directory and
        // do not collide.
        store.set("rank/0/addr", b"x").unwrap();
        store.set("rank%2F0%2Faddr", b"y").unwrap();
        store.set("../escape", b"z").unwrap();
        store.set("ü", b"u").unwrap();
        store.set("", b"empty").unwrap();
        assert_eq!(store.try_get("rank/0/addr").unwrap(), Some(b"x".to_vec()));
        assert_eq!(
            store.try_get("rank%2F0%2Faddr").unwrap(),
            Some(b"y".to_vec())
        );
        assert_eq!(store.try_get("../escape").unwrap(), Some(b"z".to_vec()));
        assert_eq!(store.try_get("ü").unwrap(), Some(b"u".to_vec()));
        assert_eq!(store.try_get("").unwrap(), Some(b"empty".to_vec()));
        assert!(!dir.join("escape").exists());
        assert!(store.set(&"k".repeat(300), b"").is_err());
        // No temporary file is left behind.
        let leftovers: Vec<_> = fs::read_dir(store.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("t_"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn escaping() {
        assert_eq!(escape_key("a.B-9_z"), "k_a.B-9_z");
        assert_eq!(escape_key("r/1"), "k_r%2F1");
        assert_eq!(escape_key("%"), "k_%25");
        assert_eq!(escape_key(".."), "k_..");
    }

    #[test]
    fn concurrent_adds_give_unique_values() {
        let dir = temp_dir("add");
        let store = Arc::new(FileStore::new(&dir).unwrap());
        let threads: Vec<_> = (0..4)
            .map(|i| {
                // Half the threads share one FileStore, half open their own.
                let store = if i % 2 == 0 {
                    Arc::clone(&store)
                } else {
                    Arc::new(FileStore::new(&dir).unwrap())
                };
                std::thread::spawn(move || {
                    (0..25)
                        .map(|_| store.add("ctr", 1).unwrap())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all: Vec<i64> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        all.sort_unstable();
        assert_eq!(all, (1..=100).collect::<Vec<_>>());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unusable_directory_is_reported() {
        let dir = temp_dir("blocked");
        fs::write(&dir, b"a file, not a directory").unwrap();
        let e = FileStore::new(dir.join("sub")).unwrap_err().to_string();
        assert!(e.contains("creating the file store directory"), "{e}");
        fs::remove_file(&dir).unwrap();
    }
}
