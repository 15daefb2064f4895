//! Drafter weights loaded once per process and shared by every proposer built from them (each
//! proposer keeps its own caches), keyed by the canonical path they were loaded from and, where
//! one file loads in several ways, by how.

use anyhow::Result;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A canonical path and the way it was loaded (empty: the default).
type LoadKey = (PathBuf, String);

pub struct WeightCache<T> {
    loaded: Mutex<Option<HashMap<LoadKey, Arc<T>>>>,
}

impl<T> WeightCache<T> {
    pub const fn new() -> Self {
        Self { loaded: Mutex::new(None) }
    }

    /// The weights loaded from `path`, by `load` the first time. `check` runs on every reuse
    /// (a cached drafter must still fit the target asking for it).
    pub fn get_or_load(
        &self,
        path: &Path,
        check: impl FnOnce(&T) -> Result<()>,
        load: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        self.get_or_load_as(path, "", check, load)
    }

    /// [`Self::get_or_load`] for one way of loading `path`, named by `variant` (weights loaded
    /// differently are kept apart).
    pub fn get_or_load_as(
        &self,
        path: &Path,
        variant: &str,
        check: impl FnOnce(&T) -> Result<()>,
        load: impl FnOnce() -> Result<T>,
    ) -> Result<Arc<T>> {
        let key = (path.canonicalize().unwrap_or_else(|_| path.to_path_buf()), variant.to_string());
        let hit = self.loaded.lock().unwrap_or_else(|e| e.into_inner()).as_ref().and_then(|m| m.get(&key).cloned());
        if let Some(weights) = hit {
            check(&weights)?;
            return Ok(weights);
        }
        // Loaded outside the lock: a slow load must not block proposers of other drafters.
        let weights = Arc::new(load()?);
        let mut guard = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        Ok(guard.get_or_insert_with(HashMap::new).entry(key).or_insert(weights).clone())
    }
}

/// The `*.safetensors` files of a drafter directory, sorted (one file or shards).
pub fn safetensors_shards(dir: &Path) -> Result<Vec<PathBuf>> {
    use anyhow::Context;
    let origin = dir.display();
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the drafter directory {origin}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    if shards.is_empty() {
        anyhow::bail!("{origin}: no *.safetensors files");
    }
    Ok(shards)
}
