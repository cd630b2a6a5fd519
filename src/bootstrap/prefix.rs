//! A view of a store under a key prefix (torch's `PrefixStore`): two
//! communicators set up through one store, e.g. a device communicator's
//! control channel beside a user's host communicator, never see each
//! other's keys.

use std::sync::Arc;
use std::time::Duration;

use super::Store;
use crate::error::Result;

/// `inner`, with every key read and written as `prefix/key`.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A view of `inner` under `prefix` (a `/` is put between the two).
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        self.inner.try_get(&self.key(key))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let missing = self.inner.wait(&full, timeout)?;
        // Missing keys are reported as the caller named them.
        Ok(keys
            .iter()
            .zip(&full)
            .filter(|(_, f)| missing.contains(f))
            .map(|(k, _)| k.clone())
            .collect())
    }

    fn describe(&self) -> String {
        format!("{} (keys under {}/)", self.inner.describe(), self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::MemoryStore;

    #[test]
    fn prefixes_keep_keys_apart() {
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let a = PrefixStore::new("a", inner.clone());
        let b = PrefixStore::new("b", inner.clone());
        a.set("k", b"1").unwrap();
        assert_eq!(a.try_get("k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(b.try_get("k").unwrap(), None);
        assert_eq!(inner.try_get("a/k").unwrap(), Some(b"1".to_vec()));
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 5);
        let missing = b
            .wait(&["k".into(), "n".into()], Duration::from_millis(10))
            .unwrap();
        assert_eq!(missing, vec!["k".to_string()]);
        assert!(a.describe().contains("a/"));
    }
}
