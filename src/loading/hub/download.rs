//! Fetching one repo file into the Hugging Face cache layout (`blobs/<etag>`, `snapshots/<commit>/<file>`,
//! `refs/<revision>`), so that huggingface_hub, hf-hub and frspec share one cache.
//!
//! frspec does this itself rather than through hf-hub's `Api` because hf-hub 0.5 trusts the hub: its size-check
//! request sends the `Authorization` header to whatever host a redirect names, and the etag and commit hash it reads
//! from response headers become path components unchecked (an etag of `../../x` writes outside the cache). Here every
//! redirect hop is followed by hand, the token goes only to the endpoint's own origin, and both names are checked.

use anyhow::{anyhow, bail, Context, Result};
use hf_hub::CacheRepo;
use std::io::Read;
use std::path::PathBuf;
use ureq::http::{header, StatusCode, Uri};
use ureq::Agent;

/// More hops than this is a redirect loop (the hub uses one: resolve → CDN).
const MAX_HOPS: usize = 10;

pub struct Downloader {
    agent: Agent,
    endpoint: String,
    token: Option<String>,
}

/// What the hub says about a file before its bytes are fetched.
struct Located {
    /// Where the bytes are, after the hub's redirects.
    url: String,
    etag: String,
    commit: String,
    size: u64,
}

impl Downloader {
    pub fn new(endpoint: &str, token: Option<String>) -> Downloader {
        let agent = Agent::config_builder().max_redirects(0).http_status_as_error(false).build().into();
        Downloader { agent, endpoint: endpoint.trim_end_matches('/').to_string(), token }
    }

    /// `file` of the repo at `repo_url` (`org/name` or `datasets/org/name`) and `revision`, into `cache`; None when
    /// the hub answers 404.
    pub fn fetch(&self, cache: &CacheRepo, repo_url: &str, revision: &str, file: &str) -> Result<Option<PathBuf>> {
        let url = format!("{}/{repo_url}/resolve/{}/{file}", self.endpoint, revision.replace('/', "%2F"));
        let Some(located) = self.locate(&url)? else { return Ok(None) };
        let blob = cache.blob_path(&located.etag);
        let blobs = blob.parent().context("blob path has no folder")?;
        std::fs::create_dir_all(blobs).with_context(|| format!("cannot create {}", blobs.display()))?;
        if !blob.exists() {
            self.download(&located, &blob)?;
        }
        let pointer = cache.pointer_path(&located.commit).join(file);
        if let Some(folder) = pointer.parent() {
            std::fs::create_dir_all(folder).with_context(|| format!("cannot create {}", folder.display()))?;
        }
        link(&blob, &pointer)?;
        cache.create_ref(&located.commit).context("cannot write the revision's ref into the cache")?;
        Ok(Some(pointer))
    }

    /// The hub's answer to a one-byte range request: commit and etag from the hub's own response, size from the
    /// response that finally carries bytes.
    fn locate(&self, url: &str) -> Result<Option<Located>> {
        let mut url = url.to_string();
        let mut named: Option<(String, String)> = None;
        for _ in 0..MAX_HOPS {
            let response = self.get(&url, Some("bytes=0-0"))?;
            let status = response.status();
            if status == StatusCode::NOT_FOUND && named.is_none() {
                return Ok(None);
            }
            if named.is_none() {
                if let Some(commit) = text_header(&response, "x-repo-commit") {
                    let etag = text_header(&response, "x-linked-etag").or_else(|| text_header(&response, "etag"));
                    let etag = etag.ok_or_else(|| anyhow!("the hub's answer for {url} has no etag"))?;
                    named = Some((cache_name("commit hash", &commit)?, cache_name("etag", &etag)?));
                }
            }
            if status.is_redirection() {
                url = redirect_target(&url, &response)?;
                continue;
            }
            if !status.is_success() {
                bail!("{url}: HTTP {status}");
            }
            let (commit, etag) = named.ok_or_else(|| anyhow!("the hub's answer for {url} has no x-repo-commit header"))?;
            let size = content_size(&response).ok_or_else(|| anyhow!("{url}: no Content-Range or Content-Length"))?;
            return Ok(Some(Located { url, etag, commit, size }));
        }
        bail!("{url}: more than {MAX_HOPS} redirects")
    }

    /// The file's bytes into `blob`, through a temporary name so that an interrupted download never looks finished.
    fn download(&self, located: &Located, blob: &std::path::Path) -> Result<()> {
        let mut url = located.url.clone();
        let mut response = self.get(&url, None)?;
        for _ in 0..MAX_HOPS {
            if !response.status().is_redirection() {
                break;
            }
            url = redirect_target(&url, &response)?;
            response = self.get(&url, None)?;
        }
        if !response.status().is_success() {
            bail!("{url}: HTTP {}", response.status());
        }
        let partial = blob.with_extension(format!("{}.incomplete", std::process::id()));
        let mut out = std::fs::File::create(&partial).with_context(|| format!("cannot create {}", partial.display()))?;
        // One byte more than promised is enough to tell a server that sends too much.
        let mut body = response.into_body().into_reader().take(located.size + 1);
        let written = std::io::copy(&mut body, &mut out).with_context(|| format!("download of {url} broke off"));
        let finished = written.and_then(|n| match n == located.size {
            true => out.sync_all().context("cannot flush the download"),
            false => Err(anyhow!("{url}: {n} bytes received, the hub announced {}", located.size)),
        });
        if let Err(e) = finished {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
        std::fs::rename(&partial, blob).with_context(|| format!("cannot move the download to {}", blob.display()))
    }

    /// One request, no redirect followed; the token only when `url` is on the endpoint's own origin.
    fn get(&self, url: &str, range: Option<&str>) -> Result<ureq::http::Response<ureq::Body>> {
        let mut request = self.agent.get(url).header(header::USER_AGENT, concat!("frspec/", env!("CARGO_PKG_VERSION")));
        if let Some(range) = range {
            request = request.header(header::RANGE, range);
        }
        if let Some(token) = &self.token {
            if same_origin(url, &self.endpoint) {
                request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
            }
        }
        request.call().map_err(|e| anyhow!("{url}: {e}"))
    }
}

/// Scheme, host and port equal: a different port is another server, which must not see the token either.
pub fn same_origin(a: &str, b: &str) -> bool {
    let origin = |url: &str| {
        let uri: Uri = url.parse().ok()?;
        let scheme = uri.scheme_str()?.to_ascii_lowercase();
        let port = uri.port_u16().or(match scheme.as_str() {
            "https" => Some(443),
            "http" => Some(80),
            _ => None,
        });
        Some((scheme, uri.host()?.to_ascii_lowercase(), port))
    };
    matches!((origin(a), origin(b)), (Some(a), Some(b)) if a == b)
}

/// Where a redirect points: an absolute URL as given, a path on the same origin as `from`.
fn redirect_target(from: &str, response: &ureq::http::Response<ureq::Body>) -> Result<String> {
    let location = text_header(response, "location").ok_or_else(|| anyhow!("{from}: a redirect without a Location"))?;
    if location.contains("://") {
        return Ok(location);
    }
    let uri: Uri = from.parse().map_err(|_| anyhow!("{from}: not a URL"))?;
    match (location.starts_with('/'), uri.scheme_str(), uri.authority()) {
        (true, Some(scheme), Some(authority)) => Ok(format!("{scheme}://{authority}{location}")),
        _ => bail!("{from}: cannot follow the redirect to {location:?}"),
    }
}

fn text_header(response: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    response.headers().get(name)?.to_str().ok().map(str::to_string)
}

/// The whole file's size: after `/` in `Content-Range: bytes 0-0/SIZE`, or the length of a full answer.
fn content_size(response: &ureq::http::Response<ureq::Body>) -> Option<u64> {
    match text_header(response, "content-range") {
        Some(range) => range.rsplit_once('/')?.1.trim().parse().ok(),
        None if response.status() == StatusCode::OK => text_header(response, "content-length")?.trim().parse().ok(),
        None => None,
    }
}

/// An etag or commit hash from the hub becomes a file or folder name in the cache: quotes and a weak-etag prefix
/// are dropped, and what is left must be one plain name.
fn cache_name(what: &str, value: &str) -> Result<String> {
    let name = value.trim().trim_start_matches("W/").trim_matches('"');
    let plain = !name.is_empty()
        && name.len() <= 128
        && !name.starts_with('.')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !plain {
        bail!("the hub sent {what} {value:?}, which is not a plain name");
    }
    Ok(name.to_string())
}

/// The snapshot entry points at its blob, relatively (as huggingface_hub does) so that the cache can move.
fn link(blob: &std::path::Path, pointer: &std::path::Path) -> Result<()> {
    if pointer.exists() {
        return Ok(());
    }
    let _ = std::fs::remove_file(pointer);
    #[cfg(unix)]
    {
        let depth = pointer.parent().map_or(0, |p| p.components().count());
        let repo = blob.parent().and_then(|b| b.parent()).map_or(0, |repo| repo.components().count());
        let mut target = PathBuf::new();
        for _ in 0..depth.saturating_sub(repo) {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob.file_name().context("blob has no name")?);
        std::os::unix::fs::symlink(&target, pointer).with_context(|| format!("cannot link {}", pointer.display()))
    }
    #[cfg(not(unix))]
    {
        std::fs::copy(blob, pointer).map(|_| ()).with_context(|| format!("cannot copy into {}", pointer.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_names_are_plain_and_origins_include_the_port() {
        assert_eq!(cache_name("etag", "\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(cache_name("etag", "W/\"5d41402abc\"").unwrap(), "5d41402abc");
        for bad in ["../../x", "a/b", "..", "", "\"\"", ".hidden", "a\\b", "x y"] {
            assert!(cache_name("etag", bad).is_err(), "{bad:?}");
        }
        assert!(same_origin("https://huggingface.co/a/resolve/main/x", "https://huggingface.co"));
        assert!(same_origin("https://HuggingFace.co/a", "https://huggingface.co/"));
        assert!(!same_origin("https://cdn-lfs.hf.co/x", "https://huggingface.co"));
        assert!(!same_origin("http://127.0.0.1:8001/x", "http://127.0.0.1:8000"));
        assert!(!same_origin("http://huggingface.co/x", "https://huggingface.co"));
        assert!(same_origin("https://huggingface.co:443/x", "https://huggingface.co"));
    }
}
