//! The in-memory store, for ranks that are threads of one process.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

#[derive(Default)]
struct Inner {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A [`Store`] in this process's memory; clones share the same map.
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // Every critical section is a single map operation: a panic cannot
        // leave the map half-updated, so a poisoned lock is still consistent.
        self.inner
            .map
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.inner.changed.notify_all();
        Ok(())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut map = self.lock();
        let current = match map.get(key) {
            None => 0,
            Some(bytes) => parse_counter(bytes).ok_or_else(|| Error::Bootstrap {
                context: format!("store {}", self.describe()),
                detail: format!("key {key:?} holds a value that is not a counter"),
            })?,
        };
        let next = current.wrapping_add(delta);
        map.insert(key.to_string(), next.to_string().into_bytes());
        self.inner.changed.notify_all();
        Ok(next)
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        // A timeout too large to add (Duration::MAX) waits as good as forever.
        let deadline = Instant::now().checked_add(timeout);
        let mut map = self.lock();
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|k| !map.contains_key(k.as_str()))
                .cloned()
                .collect();
            let now = Instant::now();
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(now),
                None => Duration::from_secs(3600),
            };
            if missing.is_empty() || left.is_zero() {
                return Ok(missing);
            }
            map = self
                .inner
                .changed
                .wait_timeout(map, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
        }
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

/// Counters are stored as decimal text (as torch's `TCPStore::add` does), so
/// every store implementation agrees on their encoding.
pub(crate) fn parse_counter(bytes: &[u8]) -> Option<i64> {
    std::str::from_utf8(bytes).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_get_add_wait() {
        let store = MemoryStore::new();
        store.set("a", b"1").unwrap();
        assert_eq!(store.try_get("a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(store.try_get("b").unwrap(), None);
        assert_eq!(store.add("n", 2).unwrap(), 2);
        assert_eq!(store.add("n", 3).unwrap(), 5);
        assert!(store.add("a", 1).is_ok(), "\"1\" is a counter");
        store.set("text", b"x").unwrap();
        assert!(store.add("text", 1).is_err());
        let missing = store
            .wait(&["a".into(), "z".into()], Duration::from_millis(20))
            .unwrap();
        assert_eq!(missing, vec!["z".to_string()]);
        let other = store.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            other.set("late", b"v").unwrap();
        });
        assert_eq!(store.get("late", Duration::from_secs(5)).unwrap(), b"v");
        t.join().unwrap();
        assert!(store.get("never", Duration::from_millis(10)).is_err());
        assert!(store.wait(&["a".into()], Duration::MAX).unwrap().is_empty());
    }
}
