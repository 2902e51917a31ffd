//! Resolving model and dataset names to local files: a local path, or a Hugging Face repo id fetched with
//! hf-hub into the usual cache, honouring HF_HOME, HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE.

mod download;

use anyhow::{bail, Context, Result};
use download::Downloader;
use hf_hub::{Cache, Repo, RepoType};
use std::path::PathBuf;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RepoKind {
    Model,
    Dataset,
}

/// `org/name` or `org/name@revision`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoId {
    pub id: String,
    pub revision: Option<String>,
}

impl RepoId {
    /// None when `spec` does not have the shape of a repo id.
    pub fn parse(spec: &str) -> Option<RepoId> {
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) if !rev.is_empty() => (id, Some(rev.to_string())),
            Some(_) => return None,
            None => (spec, None),
        };
        let ok_part = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        let mut parts = id.split('/');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(org), Some(name), None) if ok_part(org) && ok_part(name) && !org.starts_with('.') => {
                Some(RepoId { id: id.to_string(), revision })
            }
            _ => None,
        }
    }

    fn repo(&self, kind: RepoKind) -> Repo {
        let t = match kind {
            RepoKind::Model => RepoType::Model,
            RepoKind::Dataset => RepoType::Dataset,
        };
        Repo::with_revision(self.id.clone(), t, self.revision.clone().unwrap_or_else(|| "main".into()))
    }
}

pub struct Hub {
    cache: Cache,
    /// None when HF_HUB_OFFLINE is set: only the cache is consulted.
    downloader: Option<Downloader>,
    endpoint: String,
}

impl Hub {
    pub fn from_env() -> Hub {
        let cache_dir = match std::env::var_os("HF_HUB_CACHE") {
            Some(dir) => dir.into(),
            None => Cache::from_env().path().clone(),
        };
        let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
        let offline = std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !matches!(v.as_str(), "" | "0" | "false" | "False"));
        let token = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty());
        Hub::new(&endpoint, cache_dir, offline, token)
    }

    /// A client for `endpoint` with its cache in `cache_dir`; the token defaults to the one saved in the cache.
    pub fn new(endpoint: &str, cache_dir: PathBuf, offline: bool, token: Option<String>) -> Hub {
        let cache = Cache::new(cache_dir);
        let downloader = (!offline).then(|| Downloader::new(endpoint, token.or_else(|| cache.token())));
        Hub { cache, downloader, endpoint: endpoint.to_string() }
    }

    /// `text` with the credentials an endpoint like `https://user:token@host` carries replaced by `***`: errors name
    /// the endpoint (and hf-hub's errors the URL), and a log is no place for a token.
    fn redact(&self, text: &str) -> String {
        let credentials = self.endpoint.split_once("://").and_then(|(_, rest)| rest.split('/').next()?.rsplit_once('@')).map(|(c, _)| c);
        match credentials {
            Some(c) if !c.is_empty() => text.replace(c, "***"),
            _ => text.to_string(),
        }
    }

    pub fn is_offline(&self) -> bool {
        self.downloader.is_none()
    }

    /// A file of a repo, from the cache or downloaded into it.
    pub fn file(&self, kind: RepoKind, repo: &RepoId, file: &str) -> Result<PathBuf> {
        match self.optional_file(kind, repo, file)? {
            Some(path) => Ok(path),
            None if self.is_offline() => bail!(
                "{} file {file} is not in the cache at {} and HF_HUB_OFFLINE is set",
                self.describe(kind, repo),
                self.cache.path().display()
            ),
            None => bail!("{} has no file {file}", self.describe(kind, repo)),
        }
    }

    /// Like `file`, but a file the repo does not have (offline: that the cache does not have) is `None`.
    pub fn optional_file(&self, kind: RepoKind, repo: &RepoId, file: &str) -> Result<Option<PathBuf>> {
        let file = super::RepoPath::new(file).with_context(|| self.describe(kind, repo))?;
        let file = file.as_str();
        let r = repo.repo(kind);
        if let Some(path) = self.cache.repo(r.clone()).get(file) {
            return Ok(Some(path));
        }
        let Some(downloader) = &self.downloader else { return Ok(None) };
        downloader.fetch(&self.cache.repo(r.clone()), &r.url(), r.revision(), file).map_err(|e| {
            anyhow::anyhow!("{}", self.redact(&format!("cannot fetch {file} from {} at {}: {e:#}", self.describe(kind, repo), self.endpoint)))
        })
    }

    fn describe(&self, kind: RepoKind, repo: &RepoId) -> String {
        let what = match kind {
            RepoKind::Model => "model repo",
            RepoKind::Dataset => "dataset repo",
        };
        match &repo.revision {
            Some(rev) => format!("{what} {}@{rev}", repo.id),
            None => format!("{what} {}", repo.id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_parse_and_paths_do_not() {
        assert_eq!(RepoId::parse("org/name"), Some(RepoId { id: "org/name".into(), revision: None }));
        assert_eq!(RepoId::parse("org/name@v1.0").unwrap().revision.as_deref(), Some("v1.0"));
        for not_a_repo in ["name", "a/b/c", "./x", "/abs/path", "org/", "org/name@", "../x", "a b/c"] {
            assert_eq!(RepoId::parse(not_a_repo), None, "{not_a_repo}");
        }
    }
}
