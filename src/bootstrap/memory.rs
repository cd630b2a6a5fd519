//! The in-memory store, for ranks that are threads of one process.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::Store;
use crate::error::{Error, Result};

#[derive(Default)]
struct Inner {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// Every key in the order it first appeared (no key is ever removed):
    /// a waiter looks only at the keys that arrived since it last looked,
    /// so a rendezvous of N ranks, each waiting for N keys, costs O(N²)
    /// lookups rather than N for every waiter at every set (O(N³): 25 s
    /// for 4096 ranks over TCP on 2 cores).
    arrivals: Vec<String>,
}

impl State {
    fn insert(&mut self, key: &str, value: Vec<u8>) {
        if self.map.insert(key.to_string(), value).is_none() {
            self.arrivals.push(key.to_string());
        }
    }
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

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every critical section is a single map operation: a panic cannot
        // leave the map half-updated, so a poisoned lock is still consistent.
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key, value.to_vec());
        self.inner.changed.notify_all();
        Ok(())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().map.get(key).cloned())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut state = self.lock();
        let current = match state.map.get(key) {
            None => 0,
            Some(bytes) => parse_counter(bytes).ok_or_else(|| Error::Bootstrap {
                context: format!("store {}", self.describe()),
                detail: format!("key {key:?} holds a value that is not a counter"),
            })?,
        };
        let next = current.wrapping_add(delta);
        state.insert(key, next.to_string().into_bytes());
        self.inner.changed.notify_all();
        Ok(next)
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        // A timeout too large to add (Duration::MAX) waits as good as forever.
        let deadline = Instant::now().checked_add(timeout);
        let mut state = self.lock();
        // A key once present stays: only the missing ones are looked for,
        // among the arrivals since the last look.
        let mut missing: HashSet<&str> = keys
            .iter()
            .map(String::as_str)
            .filter(|k| !state.map.contains_key(*k))
            .collect();
        let mut seen = state.arrivals.len();
        loop {
            let now = Instant::now();
            let left = match deadline {
                Some(deadline) => deadline.saturating_duration_since(now),
                None => Duration::from_secs(3600),
            };
            if missing.is_empty() || left.is_zero() {
                return Ok(keys
                    .iter()
                    .filter(|k| missing.contains(k.as_str()))
                    .cloned()
                    .collect());
            }
            state = self
                .inner
                .changed
                .wait_timeout(state, left)
                .map(|(guard, _)| guard)
                .unwrap_or_else(|poisoned| poisoned.into_inner().0);
            if missing.len() < state.arrivals.len() - seen {
                missing.retain(|k| !state.map.contains_key(*k));
            } else {
                for key in &state.arrivals[seen..] {
                    missing.remove(key.as_str());
                }
            }
            seen = state.arrivals.len();
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

    /// A wait counts keys that arrive while it waits, in any order and
    /// among unrelated ones (and updates of keys already there), and
    /// returns the still-missing ones in the caller's order, duplicates
    /// kept.
    #[test]
    fn wait_follows_arrivals_in_any_order() {
        let store = MemoryStore::new();
        store.set("k1", b"early").unwrap();
        let keys: Vec<String> = ["k3", "k1", "k2", "k4", "k2"]
            .iter()
            .map(|k| k.to_string())
            .collect();
        let writer = store.clone();
        let t = std::thread::spawn(move || {
            for key in ["other", "k2", "k1", "other", "k3"] {
                std::thread::sleep(Duration::from_millis(5));
                writer.set(key, b"v").unwrap();
            }
            writer.add("counter", 1).unwrap();
        });
        let missing = store.wait(&keys, Duration::from_millis(500)).unwrap();
        t.join().unwrap();
        assert_eq!(missing, vec!["k4".to_string()]);
        store.set("k4", b"v").unwrap();
        assert!(store.wait(&keys, Duration::ZERO).unwrap().is_empty());
        let missing = store
            .wait(&["z".into(), "k1".into(), "z".into()], Duration::ZERO)
            .unwrap();
        assert_eq!(missing, vec!["z".to_string(), "z".to_string()]);
    }
}
