//! The hub code against a fake Hugging Face hub on 127.0.0.1: a model repo and the MT-Bench dataset are
//! downloaded into an HF_HOME cache, then served from it with HF_HUB_OFFLINE set.

mod common;
use common::{asset, frspec};
use frspec::loading::hub::{Hub, RepoId, RepoKind};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// What the fake hub answers for a path.
enum Reply {
    /// The file, with Range support, as hf-hub and huggingface_hub expect.
    File(Vec<u8>),
    /// A 302 to `location` carrying the hub's own headers (commit, etag), as the real hub redirects to its CDN.
    Redirect { location: String, etag: String },
}

/// Serves `GET /{prefix}/resolve/{rev}/{file}`; 404 for anything else. Counts requests and keeps, per request, its
/// path and whether it carried an `Authorization` header.
struct FakeHub {
    endpoint: String,
    requests: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<(String, bool)>>>,
}

impl FakeHub {
    fn start(files: HashMap<String, Vec<u8>>) -> FakeHub {
        FakeHub::serve(files.into_iter().map(|(path, body)| (path, Reply::File(body))).collect())
    }

    fn serve(replies: HashMap<String, Reply>) -> FakeHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (counter, log) = (requests.clone(), seen.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { break };
                counter.fetch_add(1, Ordering::SeqCst);
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut request = String::new();
                reader.read_line(&mut request).unwrap();
                let (mut range, mut authorized) = (None, false);
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap() == 0 || line == "\r\n" {
                        break;
                    }
                    let line = line.to_ascii_lowercase();
                    authorized |= line.starts_with("authorization:");
                    if let Some(v) = line.strip_prefix("range: bytes=") {
                        let (a, b) = v.trim().split_once('-').unwrap();
                        range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                    }
                }
                let path = request.split_whitespace().nth(1).unwrap_or("").to_string();
                log.lock().unwrap().push((path.clone(), authorized));
                const COMMIT: &str = "x-repo-commit: 0123456789abcdef0123456789abcdef01234567";
                match replies.get(&path) {
                    Some(Reply::File(body)) => {
                        let (start, end) = match range {
                            Some((a, b)) => (a, b.map_or(body.len(), |b| (b + 1).min(body.len()))),
                            None => (0, body.len()),
                        };
                        let part = &body[start..end];
                        let head = format!(
                            "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {}-{}/{}\r\n\
                             ETag: \"etag-{:x}\"\r\n{COMMIT}\r\nConnection: close\r\n\r\n",
                            part.len(), start, end.saturating_sub(1), body.len(), body.len() * 31 + path.len()
                        );
                        let _ = stream.write_all(head.as_bytes());
                        let _ = stream.write_all(part);
                    }
                    Some(Reply::Redirect { location, etag }) => {
                        let location = if location.is_empty() { String::new() } else { format!("Location: {location}\r\n") };
                        let head = format!(
                            "HTTP/1.1 302 Found\r\n{location}ETag: {etag}\r\n{COMMIT}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        );
                        let _ = stream.write_all(head.as_bytes());
                    }
                    None => {
                        let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                    }
                }
            }
        });
        FakeHub { endpoint, requests, seen }
    }
}

/// frspec run with `args` against `hub`, its cache in `home`, online or offline.
fn against(hub: &FakeHub, home: &Path, args: &[&str], offline: bool) -> std::process::Output {
    let mut cmd = frspec();
    cmd.args(args).env("HF_ENDPOINT", &hub.endpoint).env("HF_HOME", home).env_remove("HF_HUB_CACHE");
    if offline {
        cmd.env("HF_HUB_OFFLINE", "1");
    } else {
        cmd.env_remove("HF_HUB_OFFLINE");
    }
    cmd.output().unwrap()
}

fn repo_files(prefix: &str, dir: &Path) -> HashMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| (format!("{prefix}/resolve/main/{}", p.file_name().unwrap().to_str().unwrap()), std::fs::read(&p).unwrap()))
        .collect()
}

#[test]
fn model_and_dataset_download_then_load_offline() {
    let model_dir = tempfile::tempdir().unwrap();
    frspec::synthetic::write_model(model_dir.path(), &frspec::synthetic::Shape::tiny(), 5, candle_core::DType::F16).unwrap();
    let mut files = repo_files("/tiny-org/tiny-llama", model_dir.path());
    let eagle = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/fixtures/eagle1-tiny");
    files.extend(repo_files("/tiny-org/tiny-eagle", &eagle));
    // A repo whose index names a shard outside the repo: the name would be joined onto the cache path.
    let mut evil = repo_files("/evil-org/evil-llama", model_dir.path());
    let escape = r#"{"weight_map": {"model.embed_tokens.weight": "../../../../../escape.safetensors"}}"#;
    evil.insert("/evil-org/evil-llama/resolve/main/model.safetensors.index.json".into(), escape.as_bytes().to_vec());
    files.extend(evil);
    let questions = std::fs::read(asset("mt-bench")).unwrap();
    files.insert("/datasets/philschmid/mt-bench/resolve/main/question.jsonl".into(), questions.clone());
    let hub = FakeHub::start(files);
    let home = tempfile::tempdir().unwrap();

    // Through the CLI: resolve the repo id, download, load and score.
    let tokens = home.path().join("tokens.json");
    std::fs::write(&tokens, "[256, 72, 105, 257]").unwrap();
    let score = |offline: bool| {
        let out = against(&hub, home.path(), &["score", "--json", "--model", "tiny-org/tiny-llama", "--tokens-file", tokens.to_str().unwrap()], offline);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let online = score(false);
    assert!(hub.requests.load(Ordering::SeqCst) > 0);
    let before = hub.requests.load(Ordering::SeqCst);
    let offline = score(true);
    assert_eq!(online, offline, "the cached model scores the same");
    assert_eq!(hub.requests.load(Ordering::SeqCst), before, "offline mode made requests");
    assert!(home.path().join("hub/models--tiny-org--tiny-llama/snapshots").is_dir());

    // An EAGLE head that ships pytorch_model.bin, as yuhuili's do, drafting for the tiny target.
    let generate = ["generate", "--model", "tiny-org/tiny-llama", "--draft", "tiny-org/tiny-eagle", "--prompt", "Hi", "--max-new-tokens", "8"];
    let out = against(&hub, home.path(), &generate, false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.contains("EAGLE-1 head") && stderr.contains("mean acceptance length"), "{stderr}");

    // Names that would leave the cache are refused before any request or path is made of them.
    let out = against(&hub, home.path(), &["score", "--model", "evil-org/evil-llama", "--tokens-file", tokens.to_str().unwrap()], false);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(1) && stderr.contains("model repo evil-org/evil-llama: file name \"../../../../../escape.safetensors\" is not a plain relative path"), "{stderr}");

    // Through the library: a dataset file, and a file the repo does not have.
    let hub_client = Hub::new(&hub.endpoint, home.path().join("hub"), false, None);
    let repo = RepoId::parse("philschmid/mt-bench").unwrap();
    let got = hub_client.file(RepoKind::Dataset, &repo, "question.jsonl").unwrap();
    assert_eq!(std::fs::read(got).unwrap(), questions);
    assert_eq!(hub_client.optional_file(RepoKind::Dataset, &repo, "missing.jsonl").unwrap(), None);
    let err = hub_client.file(RepoKind::Dataset, &repo, "missing.jsonl").unwrap_err();
    assert!(err.to_string().contains("philschmid/mt-bench has no file missing.jsonl"), "{err}");
    for name in ["../question.jsonl", "/etc/passwd", "a/../../b", "", "a\\..\\b"] {
        let err = hub_client.file(RepoKind::Dataset, &repo, name).unwrap_err();
        assert!(format!("{err:#}").contains("is not a plain relative path"), "{name}: {err:#}");
    }
}

#[test]
fn unreachable_hub_is_a_clear_error() {
    // Bind then drop a listener: nothing answers on that port.
    let endpoint = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let home = tempfile::tempdir().unwrap();
    let hub = Hub::new(&endpoint, home.path().join("hub"), false, None);
    let err = hub.file(RepoKind::Model, &RepoId::parse("org/model").unwrap(), "config.json").unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("org/model") && msg.contains(&endpoint), "{msg}");
    // Credentials in the endpoint never reach an error.
    let with_token = endpoint.replace("http://", "http://someone:hf_secret123@");
    let hub = Hub::new(&with_token, home.path().join("hub"), false, None);
    let msg = format!("{:#}", hub.file(RepoKind::Model, &RepoId::parse("org/model").unwrap(), "config.json").unwrap_err());
    assert!(!msg.contains("hf_secret123") && !msg.contains("someone") && msg.contains("***@127.0.0.1"), "{msg}");
}

#[test]
fn the_token_stays_with_the_hub_and_the_hub_cannot_name_paths_outside_its_cache() {
    let config = b"{\"model_type\": \"llama\"}".to_vec();
    let cdn = FakeHub::start(HashMap::from([("/blobs/config".to_string(), config.clone())]));
    let to_cdn = |etag: &str| Reply::Redirect { location: format!("{}/blobs/config", cdn.endpoint), etag: etag.into() };
    let hub = FakeHub::serve(HashMap::from([
        ("/org/m/resolve/main/config.json".to_string(), to_cdn("\"abc123\"")),
        ("/org/escape/resolve/main/config.json".to_string(), to_cdn("\"../../../../escaped\"")),
        ("/org/lost/resolve/main/config.json".to_string(), Reply::Redirect { location: String::new(), etag: "\"abc\"".into() }),
        ("/org/loop/resolve/main/config.json".to_string(), Reply::Redirect { location: "/org/loop/resolve/main/config.json".into(), etag: "\"abc\"".into() }),
    ]));
    let home = tempfile::tempdir().unwrap();
    let cache = home.path().join("hub");
    let client = Hub::new(&hub.endpoint, cache.clone(), false, Some("hf_secret".into()));
    let file = |repo: &str| client.file(RepoKind::Model, &RepoId::parse(repo).unwrap(), "config.json");

    // The hub redirects to a CDN on another origin (here: another port): the hub hears the token, the CDN never.
    let got = file("org/m").unwrap();
    assert_eq!(std::fs::read(&got).unwrap(), config);
    assert!(got.starts_with(&cache) && cache.join("models--org--m/blobs/abc123").is_file(), "{}", got.display());
    let hub_seen = hub.seen.lock().unwrap().clone();
    let cdn_seen = cdn.seen.lock().unwrap().clone();
    assert!(!hub_seen.is_empty() && hub_seen.iter().all(|(_, auth)| *auth), "{hub_seen:?}");
    assert!(!cdn_seen.is_empty() && cdn_seen.iter().all(|(_, auth)| !auth), "the CDN received the token: {cdn_seen:?}");
    // Served from the cache now: no request.
    let before = hub.requests.load(Ordering::SeqCst);
    assert_eq!(file("org/m").unwrap(), got);
    assert_eq!(hub.requests.load(Ordering::SeqCst), before);

    // An etag is a file name in the cache: one that climbs out is refused, and nothing is written outside.
    let err = format!("{:#}", file("org/escape").unwrap_err());
    assert!(err.contains("etag") && err.contains("not a plain name"), "{err}");
    assert!(!home.path().join("escaped").exists() && !cache.join("escaped").exists());
    // A redirect without a Location, and one to itself forever: errors, not panics or hangs.
    let err = format!("{:#}", file("org/lost").unwrap_err());
    assert!(err.contains("a redirect without a Location"), "{err}");
    let err = format!("{:#}", file("org/loop").unwrap_err());
    assert!(err.contains("more than 10 redirects"), "{err}");
}
