//! Bad input gets one clear error naming the file or field and a non-zero exit, never a panic.

mod common;
use common::{asset, frspec};
use frspec::synthetic::{self, Shape};
use std::path::Path;

/// Run frspec and return its stderr, checking it failed cleanly.
fn fails(args: &[&str], envs: &[(&str, &Path)]) -> String {
    let mut cmd = frspec();
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    // 1 for frspec's own errors, 2 for flags clap rejects while parsing; never a signal.
    assert!(matches!(out.status.code(), Some(1 | 2)), "expected exit 1 or 2 for {args:?}; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    assert!(stderr.starts_with("error: "), "{args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "{args:?} wrote partial output");
    stderr
}

fn tokens_file(dir: &Path) -> String {
    let f = dir.join("tokens.json");
    std::fs::write(&f, "[1, 2, 3]").unwrap();
    f.display().to_string()
}

fn score_fails(model: &Path) -> String {
    let dir = tempfile::tempdir().unwrap();
    fails(&["score", "--model", model.to_str().unwrap(), "--tokens-file", &tokens_file(dir.path())], &[])
}

#[test]
fn missing_model_file() {
    let err = score_fails(Path::new("/nonexistent/model.gguf"));
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn truncated_and_garbage_gguf() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::read(asset("smollm2")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let err = score_fails(&cut);
    assert!(err.contains("cut.gguf") && err.contains("truncated"), "{err}");
    let garbage = dir.path().join("garbage.gguf");
    std::fs::write(&garbage, &full[..100]).unwrap();
    let err = score_fails(&garbage);
    assert!(err.contains("garbage.gguf") && err.contains("GGUF"), "{err}");
}

#[test]
fn unsupported_gguf_architecture() {
    use candle_core::quantized::gguf_file::{write, Value};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mamba.gguf");
    let arch = Value::String("mamba".into());
    write(&mut std::fs::File::create(&path).unwrap(), &[("general.architecture", &arch)], &[]).unwrap();
    let err = score_fails(&path);
    assert!(err.contains("mamba.gguf") && err.contains("architecture 'mamba' is not supported"), "{err}");
}

fn synthetic_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_model(dir.path(), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    dir
}

#[test]
fn index_naming_a_shard_outside_the_folder() {
    // The shard exists, outside the model folder: it must not be read.
    let dir = synthetic_dir();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for f in std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().path()) {
        if f.is_file() && f.file_name().unwrap() != "model.safetensors" {
            std::fs::rename(&f, model.join(f.file_name().unwrap())).unwrap();
        }
    }
    let index = r#"{"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}"#;
    std::fs::write(model.join("model.safetensors.index.json"), index).unwrap();
    let err = score_fails(&model);
    assert!(err.contains("model.safetensors.index.json") && err.contains("\"../model.safetensors\" is not a plain relative path"), "{err}");
}

#[test]
fn truncated_safetensors() {
    let dir = synthetic_dir();
    let file = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 1000]).unwrap();
    let err = score_fails(dir.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn unsupported_architecture_and_dtype() {
    let dir = synthetic_dir();
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(&config, text).unwrap();
    let err = score_fails(dir.path());
    assert!(err.contains("config.json") && err.contains("GPT2LMHeadModel"), "{err}");

    let dir = synthetic_dir();
    let file = dir.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let w = tensors.get("model.layers.0.mlp.up_proj.weight").unwrap().to_dtype(candle_core::DType::I64).unwrap();
    tensors.insert("model.layers.0.mlp.up_proj.weight".into(), w);
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let err = score_fails(dir.path());
    assert!(err.contains("model.layers.0.mlp.up_proj.weight") && err.contains("dtype"), "{err}");
}

#[test]
fn unknown_repo_while_offline() {
    let home = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let err = fails(
        &["score", "--model", "nobody/no-such-model", "--tokens-file", &tokens_file(dir.path())],
        &[("HF_HOME", home.path()), ("HF_HUB_OFFLINE", Path::new("1"))],
    );
    assert!(err.contains("nobody/no-such-model") && err.contains("HF_HUB_OFFLINE"), "{err}");
}

#[test]
fn malformed_tokens_file_and_out_of_range_ids() {
    let model = synthetic_dir();
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[1, 2, \"x\"]").unwrap();
    let m = model.path().to_str().unwrap();
    let err = fails(&["score", "--model", m, "--tokens-file", bad.to_str().unwrap()], &[]);
    assert!(err.contains("bad.json"), "{err}");
    std::fs::write(&bad, "[1, 99999]").unwrap();
    let err = fails(&["score", "--model", m, "--tokens-file", bad.to_str().unwrap()], &[]);
    assert!(err.contains("99999"), "{err}");
}

#[test]
fn bad_flags() {
    let model = synthetic_dir();
    let m = model.path().to_str().unwrap();
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--device", "cuda:0"], &[]);
    assert!(err.contains("--device cuda:0"), "{err}");
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--temperature=-1"], &[]);
    assert!(err.contains("temperature"), "{err}");
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--top-p", "0"], &[]);
    assert!(err.contains("top-p"), "{err}");
    let err = fails(&["bench", "decode", "--model", m, "--candle", "--batches", "8,0"], &[]);
    assert!(err.contains("--batches: every batch is 1 to 1024"), "{err}");
}

#[test]
fn bad_speculative_flags() {
    let m = asset("smollm2");
    let m = m.to_str().unwrap();
    let freq = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/fixtures/freq/token_freq.npy");
    let base = ["generate", "--model", m, "--prompt", "x", "--draft-kind", "truncated:1"];
    let with = |extra: &[&'static str]| -> Vec<&str> { base.iter().chain(extra).copied().collect() };
    let err = fails(&with(&["--k", "0"]), &[]);
    assert!(err.contains("--k must be at least 1"), "{err}");
    let err = fails(&with(&["--freq", freq, "--ratio", "1.0"]), &[]);
    assert!(err.contains("pruning ratio must be in [0, 1)"), "{err}");
    let err = fails(&with(&["--ratio", "0.5"]), &[]);
    assert!(err.contains("--ratio/--keep/--mass need --freq"), "{err}");
    // The fixture ranks a 16-id vocabulary; SmolLM2 has 49,152.
    let err = fails(&with(&["--freq", freq, "--ratio", "0.5"]), &[]);
    assert!(err.contains("token_freq.npy was built for a vocabulary of 16 ids, the target has 49152"), "{err}");
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--draft-kind", "truncated:0"], &[]);
    assert!(err.contains("truncated:N"), "{err}");
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--draft-kind", "eagle"], &[]);
    assert!(err.contains("needs --draft"), "{err}");
}

#[test]
fn bad_frequency_build_input() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("f.safetensors");
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let args = |corpus: &str| {
        vec!["freq".to_string(), "build".into(), "--tokenizer".into(), "smollm2".into(), "--corpus".into(), corpus.into(),
             "--out".into(), out.display().to_string()]
    };
    let run = |a: Vec<String>| fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    let err = run(args(empty.to_str().unwrap()));
    assert!(err.contains("holds no tokens"), "{err}");
    let err = run(args("/no/such/corpus.txt"));
    assert!(err.contains("/no/such/corpus.txt"), "{err}");
    assert!(!out.exists(), "no partial output");
}

#[test]
fn frequencies_from_sharegpt_answers_count_the_assistant_turns_only() {
    let dir = tempfile::tempdir().unwrap();
    let (sharegpt, out) = (dir.path().join("sharegpt.json"), dir.path().join("f.safetensors"));
    let records = [
        sharegpt_record("a", &[("human", "Write a loop."), ("gpt", "for i in range(3):\\n    print(i)")]),
        sharegpt_record("b", &[("human", "Thanks."), ("gpt", "You are welcome.")]),
    ];
    std::fs::write(&sharegpt, format!("[\n{},\n{{\"id\": \"c\", \"conversations\": [{{\"from\": \"gpt\", \"val", records.join(",\n"))).unwrap();
    let (s, o) = (sharegpt.to_str().unwrap(), out.to_str().unwrap());
    let done = frspec().args(["freq", "build", "--tokenizer", "smollm2", "--corpus", s, "--format", "sharegpt", "--out", o]).output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let tokenizer = frspec::loading::target::load_tokenizer("smollm2").unwrap();
    let mut expected = vec![0u64; tokenizer.vocab_size];
    for answer in ["for i in range(3):\n    print(i)", "You are welcome."] {
        tokenizer.encode(answer).unwrap().into_iter().for_each(|id| expected[id as usize] += 1);
    }
    let f = frspec::vocab::Frequencies::load(&out).unwrap();
    let mut counted = vec![0u64; tokenizer.vocab_size];
    f.ranking.iter().zip(f.counts.unwrap()).for_each(|(&id, c)| counted[id as usize] = c);
    let differing: Vec<usize> = (0..counted.len()).filter(|&i| counted[i] != expected[i]).collect();
    assert!(differing.is_empty(), "the answers, line breaks kept, no request: ids {differing:?} differ");
    assert_eq!(f.metadata["tokens"], expected.iter().sum::<u64>().to_string());
    std::fs::remove_file(&out).unwrap();
    std::fs::write(&sharegpt, "[{\"id\": \"a\", \"conversations\": 3}]").unwrap();
    let err = fails(&["freq", "build", "--tokenizer", "smollm2", "--corpus", s, "--format", "sharegpt", "--out", o], &[]);
    assert!(err.contains("sharegpt.json") && !out.exists(), "{err}");
}

#[test]
fn coverage_on_another_frequency_file_counts_its_tokens_among_the_kept_ids() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, counts: &[u64], tokenizer_hash: u64| {
        let path = dir.path().join(name);
        frspec::vocab::Frequencies::counted(counts, "t", tokenizer_hash, "c".into(), &path).save(&path).unwrap();
        path.to_str().unwrap().to_string()
    };
    // Ratio 0.5 of 4 ids keeps a's top two, ids 0 and 1: 15 of a's 16 tokens, 1 of b's 10.
    let (a, b, other_tokenizer) = (write("a.safetensors", &[10, 5, 1, 0], 7), write("b.safetensors", &[0, 1, 3, 6], 7), write("c.safetensors", &[1, 1, 1, 1], 8));
    let out = frspec().args(["freq", "show", &a, "--on", &b, "--ratios", "0.5"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && stdout.lines().last() == Some("    0.5        2     93.75%     10.00%"), "{stdout}");
    let err = fails(&["freq", "show", &a, "--on", &other_tokenizer], &[]);
    assert!(err.contains("count different vocabularies (tokenizer_hash 0000000000000007 and 0000000000000008)"), "{err}");
}

#[test]
fn frequencies_from_target_outputs_and_bad_datasets() {
    let model = synthetic_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("q.jsonl");
    std::fs::write(&data, "{\"question_id\": 1, \"turns\": [\"Hello\"]}\n{\"question_id\": 2, \"turns\": [\"Hi there\"]}\n").unwrap();
    let out = dir.path().join("target-dist.safetensors");
    let (m, d, o) = (model.path().to_str().unwrap(), data.to_str().unwrap(), out.to_str().unwrap());
    let args = ["freq", "from-outputs", "--model", m, "--dataset", d, "--max-new-tokens", "5", "--out", o];
    let status = frspec().args(args).output().unwrap();
    assert!(status.status.success(), "{}", String::from_utf8_lossy(&status.stderr));
    let f = frspec::vocab::Frequencies::load(&out).unwrap();
    let counted: u64 = f.counts.as_ref().unwrap().iter().sum();
    assert!((2..=10).contains(&counted), "2 prompts × ≤ 5 tokens, counted {counted}");
    assert_eq!(f.metadata["tokens"], counted.to_string());

    std::fs::write(&data, "{\"question_id\": 1, \"turns\": [\"Hello\"]}\n{\"question_id\": 2, \"turns\": 7}\n").unwrap();
    std::fs::remove_file(&out).unwrap();
    let err = fails(&args, &[]);
    assert!(err.contains("q.jsonl line 2"), "{err}");
    assert!(!out.exists(), "no partial output");
}

#[test]
fn missing_text_file_and_frequency_file() {
    let model = synthetic_dir();
    let m = model.path().to_str().unwrap();
    let err = fails(&["score", "--model", m, "--text-file", "/no/such/text.txt"], &[]);
    assert!(err.contains("/no/such/text.txt"), "{err}");
    let err = fails(&["freq", "show", "/no/such/freq.safetensors"], &[]);
    assert!(err.contains("/no/such/freq.safetensors") && err.contains("does not exist"), "{err}");
}

#[test]
fn bad_sweeps_fail_before_writing_anything() {
    let model = synthetic_dir();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("q.jsonl");
    std::fs::write(&data, "{\"question_id\": 81, \"category\": \"math\", \"turns\": [\"Hello\"]}\n").unwrap();
    let out = dir.path().join("out");
    let (m, d, o) = (model.path().to_str().unwrap(), data.to_str().unwrap(), out.to_str().unwrap());
    let base = ["sweep", "--model", m, "--draft-kind", "truncated:1", "--dataset", d, "--ratios", "0", "--out", o, "--quiet"];
    let sweep_fails = |extra: &[&str]| {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        let err = fails(&args, &[]);
        assert!(!out.exists(), "{extra:?} left {}", out.display());
        err
    };
    for (extra, want) in [
        (&["--turns", "2"][..], "question 81 has 1 turn(s); the sweep asks for 2"),
        (&["--ratios", "0,1.5"], "pruning ratio must be in [0, 1), got 1.5"),
        (&["--ratios", "0,0.5"], "--freq"),
        (&["--preset", "gpt5"], "unknown preset `gpt5`"),
        (&["--category", "poetry"], "no question of category poetry (it has: math)"),
        (&["--num-prompts", "2"], "has 1 matching questions"),
        (&["--speculative-config", "{\"method\": \"ngram\"}"], "method `ngram`"),
        // Numbers without bounds: refused up front, not a panic, an allocation abort or hours of running.
        (&["--ratios", "0,nan"], "flags: ratios NaN is not a finite number"),
        (&["--temperatures", "inf"], "flags: temperatures inf is not a finite number"),
        (&["--temperatures", "1e39"], "temperatures inf is not a finite number"),
        (&["--repeats", "1000000000"], "the sweep holds 2000000000 turns"),
        (&["--k", "1000000"], "k is 1000000: a step drafts at most 64 tokens"),
        (&["--max-new-tokens", "1000000000"], "max_new_tokens is 1000000000: the model's context holds"),
        (&["--batch", "0"], "batch is 0: a sweep decodes 1 to 1024 sequences together"),
        (&["--batch", "100000"], "batch is 100000: a sweep decodes 1 to 1024 sequences together"),
    ] {
        let err = sweep_fails(extra);
        assert!(err.contains(want), "{extra:?}: {err}");
    }

    let file = dir.path().join("sweep.toml");
    std::fs::write(&file, "ratios = []\n").unwrap();
    let with_file = ["--config", file.to_str().unwrap()];
    let args: Vec<&str> = base.iter().filter(|a| !["--ratios", "0"].contains(a)).chain(&with_file).copied().collect();
    let err = fails(&args, &[]);
    assert!(err.contains("the sweep matrix is empty"), "{err}");
    std::fs::write(&file, "temperatures = [0.0, nan]\n").unwrap();
    let err = sweep_fails(&with_file);
    assert!(err.contains("sweep file: temperatures NaN is not a finite number"), "{err}");
    std::fs::write(&file, "ratio = [0.5]\n").unwrap();
    let err = sweep_fails(&with_file);
    assert!(err.contains("sweep.toml") && err.contains("unknown field `ratio`"), "{err}");

    std::fs::write(&data, "{\"question_id\": 81, \"turns\": [\"Hello\"]}\n{\"question_id\": 81, \"turns\": [\"Hi\"]}\n").unwrap();
    let err = sweep_fails(&[]);
    assert!(err.contains("q.jsonl line 2: question id 81 is already the id of line 1"), "{err}");
    std::fs::write(&data, "{\"question_id\": 81, \"turns\": [\"Hello\"]}\n{\"question_id\": 82, \"turns\": [\"Hi\"],\n").unwrap();
    let err = sweep_fails(&[]);
    assert!(err.contains("q.jsonl line 2"), "{err}");
    std::fs::remove_file(&data).unwrap();
    let err = sweep_fails(&[]);
    assert!(err.contains("q.jsonl"), "{err}");

    // A folder holding something else is never written into.
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    std::fs::write(&data, "{\"question_id\": 81, \"turns\": [\"Hello\"]}\n").unwrap();
    let err = fails(&base, &[]);
    assert!(err.contains("does not hold a frspec sweep"), "{err}");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
}

#[test]
fn bad_training_input() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "\n  \n\n").unwrap();
    let model = synthetic_dir();
    let out = dir.path().join("head");
    let (m, c, o) = (model.path().to_str().unwrap(), corpus.to_str().unwrap(), out.to_str().unwrap());
    let base = ["train-eagle", "--target", m, "--corpus", c, "--out", o, "--prompts", "2", "--batch", "1", "--max-new-tokens", "4", "--quiet"];
    let err = fails(&base, &[]);
    assert!(err.contains("corpus.txt) holds no text"), "{err}");
    assert!(!out.exists(), "no partial output");

    // A target whose weights have no LM head (untied, lm_head.weight missing).
    let headless = tempfile::tempdir().unwrap();
    synthetic::write_model(headless.path(), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
    let file = headless.path().join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    tensors.remove("lm_head.weight");
    candle_core::safetensors::save(&tensors, &file).unwrap();
    std::fs::write(&corpus, "the river town council voted to build a new bridge over quiet water\n").unwrap();
    let args: Vec<&str> = base.iter().map(|a| if *a == m { headless.path().to_str().unwrap() } else { a }).collect();
    let err = fails(&args, &[]);
    assert!(err.contains("lm_head.weight"), "{err}");
    assert!(!out.exists(), "no partial output");

    // Continuations need a passage that has a next one; this corpus is one passage.
    let err = fails(&[&base[..], &["--continuations", "2"]].concat(), &[]);
    assert!(err.contains("fewer than two passages"), "{err}");
    assert!(!out.exists(), "no partial output");

    // --freq takes the names a sweep takes; one not built in this cache says how to make it.
    let empty_cache = tempfile::tempdir().unwrap();
    let err = fails(&[&base[..], &["--freq", "brown-smollm2", "--ratio", "0.5"]].concat(), &[("FRSPEC_CACHE", empty_cache.path())]);
    assert!(err.contains("freq/brown-smollm2.safetensors") && err.contains("scripts/build-freq.sh"), "{err}");
    assert!(!out.exists(), "no partial output");

    for (flag, value) in [("--lr", "-1e-3"), ("--weight-decay", "NaN"), ("--classification-weight", "-1"), ("--feature-weight", "-0.5"), ("--feature-weight", "inf"), ("--unroll-decay", "NaN")] {
        let err = fails(&[&base[..], &[&format!("{flag}={value}")]].concat(), &[]);
        assert!(err.contains(&format!("{flag} must be a finite number ≥ 0")), "{flag} {value}: {err}");
        assert!(!out.exists(), "no partial output");
    }

    // A templates file whose second template has no place for the passage, and one that is not a list.
    let templates = dir.path().join("templates.json");
    std::fs::write(&templates, r#"["Explain: {}", "Explain this."]"#).unwrap();
    let err = fails(&[&base[..], &["--templates", templates.to_str().unwrap()]].concat(), &[]);
    assert!(err.contains("templates.json: template 2 must hold {} (where the passage goes) exactly once"), "{err}");
    std::fs::write(&templates, r#"{"a": "{}"}"#).unwrap();
    let err = fails(&[&base[..], &["--templates", templates.to_str().unwrap()]].concat(), &[]);
    assert!(err.contains("templates.json: not a JSON list of template strings"), "{err}");
    std::fs::write(&templates, "[]").unwrap();
    let err = fails(&[&base[..], &["--templates", templates.to_str().unwrap()]].concat(), &[]);
    assert!(err.contains("templates.json: holds no template"), "{err}");
    let err = fails(&[&base[..], &["--templates", dir.path().join("missing.json").to_str().unwrap()]].concat(), &[]);
    assert!(err.contains("cannot read templates file") && err.contains("missing.json"), "{err}");
    assert!(!out.exists(), "no partial output");

    // A folder holding another run.
    let mut ok_args: Vec<&str> = base.to_vec();
    ok_args.extend(["--steps", "2"]);
    let done = frspec().args(&ok_args).output().unwrap();
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(out.join("config.json").exists() && out.join("model.safetensors").exists());
    let err = fails(&[&ok_args[..], &["--classification-weight", "1"]].concat(), &[]);
    assert!(err.contains("holds another training run (differs in: settings)"), "{err}");
    // Other templates make other prompts, so other teacher data.
    std::fs::write(&templates, r#"["Explain: {}"]"#).unwrap();
    let err = fails(&[&ok_args[..], &["--templates", templates.to_str().unwrap()]].concat(), &[]);
    assert!(err.contains("holds another training run (differs in: data)"), "{err}");
    // The corpus is known by its content: edited in place, it makes other teacher data.
    let text = std::fs::read_to_string(&corpus).unwrap();
    std::fs::write(&corpus, format!("{text}\nA sentence added later, so the passages differ now.\n")).unwrap();
    let err = fails(&ok_args, &[]);
    assert!(err.contains("holds another training run (differs in: data)"), "{err}");
    std::fs::write(&corpus, text).unwrap();
    ok_args.extend(["--seed", "9"]);
    let err = fails(&ok_args, &[]);
    assert!(err.contains("holds another training run (differs in: data, settings)"), "{err}");
}

/// A corpus of twelve lines of eight words, in `dir`: four passages.
fn twelve_line_corpus(dir: &Path) -> std::path::PathBuf {
    let corpus = dir.join("corpus.txt");
    let words = ["the", "river", "town", "council", "voted", "to", "build", "a", "new", "bridge"];
    let lines: Vec<String> = (0..12).map(|i| (0..8).map(|j| words[(i * 3 + j * 7) % words.len()]).collect::<Vec<_>>().join(" ")).collect();
    std::fs::write(&corpus, lines.join("\n")).unwrap();
    corpus
}

#[test]
fn teacher_data_is_reused_part_by_part() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = twelve_line_corpus(dir.path());
    let model = synthetic_dir();
    let (m, c) = (model.path().to_str().unwrap(), corpus.to_str().unwrap());
    let args_for = |out: &Path, prompts: &str, continuations: &str, self_prompts: &str, extra: &[&str]| -> Vec<String> {
        let mut args = vec!["train-eagle", "--target", m, "--corpus", c, "--out", out.to_str().unwrap(), "--prompts", prompts, "--self-prompts", self_prompts];
        // Requests the target writes itself need room to end their turn.
        args.extend(["--continuations", continuations, "--batch", "1", "--max-new-tokens", "48", "--steps", "1", "--quiet"]);
        args.extend(extra);
        args.into_iter().map(String::from).collect()
    };
    let run_with = |out: &str, prompts: &str, continuations: &str, self_prompts: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        (frspec().args(args_for(&out, prompts, continuations, self_prompts, extra)).output().unwrap(), out)
    };
    let run = |out: &str, prompts: &str, self_prompts: &str, extra: &[&str]| run_with(out, prompts, "2", self_prompts, extra);
    let (done, first) = run("first", "2", "2", &[]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let from = first.to_str().unwrap();
    // More generated conversations: the continuations and the self-prompted conversations are the same and are
    // taken over; the answers are made anew.
    let (done, second) = run("second", "3", "2", &["--teacher-from", from]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let bytes = |p: std::path::PathBuf| std::fs::read(p).unwrap();
    for same in ["continuations.safetensors", "self-prompts.json", "self-prompts.safetensors"] {
        assert_eq!(bytes(second.join(same)), bytes(first.join(same)), "{same}");
        // Taken whole, a file is linked, not copied (the two folders are on one file system).
        let inode = |p: std::path::PathBuf| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap());
        assert_eq!(inode(second.join(same)), inode(first.join(same)), "{same}");
    }
    assert_ne!(bytes(second.join("teacher.safetensors")), bytes(first.join("teacher.safetensors")));
    let requests: Vec<String> = serde_json::from_slice(&bytes(first.join("self-prompts.json"))).unwrap();
    assert_eq!(requests.len(), 2);
    // Data made with other activations is other data: neither taken over nor resumed.
    let kquants = [("FRSPEC_ACTIVATIONS", Path::new("kquants"))];
    let fails_in_kquants = |out: &Path, extra: &[&str]| fails(&args_for(out, "2", "2", "2", extra).iter().map(String::as_str).collect::<Vec<_>>(), &kquants);
    let taker = dir.path().join("kquants");
    let err = fails_in_kquants(&taker, &["--teacher-from", from]);
    assert!(err.contains("none of its teacher data"), "{err}");
    assert!(!taker.exists(), "no partial output");
    let err = fails_in_kquants(&first, &[]);
    assert!(err.contains("holds another training run (differs in: continuations, data, self_prompts)"), "{err}");
    // Fewer of every part: the first ones of the larger folder, byte for byte what a run from nothing makes.
    let (done, fewer) = run_with("fewer", "2", "1", "1", &["--teacher-from", second.to_str().unwrap()]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let (done, alone) = run_with("alone", "2", "1", "1", &[]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    for part in ["teacher.safetensors", "continuations.safetensors", "self-prompts.json", "self-prompts.safetensors"] {
        assert_eq!(bytes(fewer.join(part)), bytes(alone.join(part)), "{part}");
    }
    assert_ne!(bytes(fewer.join("teacher.safetensors")), bytes(second.join("teacher.safetensors")));
    // More of every part: the smaller folder's conversations and the rest made now, byte for byte what the larger
    // run made from nothing (self-prompted requests are written again, and must come out the same).
    let (done, grown) = run_with("grown", "3", "2", "2", &["--teacher-from", fewer.to_str().unwrap()]);
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{said}");
    for taken in [
        "teacher data: the first 2 of 3 conversations cached",
        "continuations: the first 1 of 2 conversations cached",
        "self-prompts: 1 of 2 cached",
        "self-prompted answers: the first 1 of 2 conversations cached",
    ] {
        assert!(said.contains(taken), "{said}");
    }
    for part in ["teacher.safetensors", "continuations.safetensors", "self-prompts.json", "self-prompts.safetensors"] {
        assert_eq!(bytes(grown.join(part)), bytes(second.join(part)), "{part}");
    }
    // Another seed shares no part.
    let (done, third) = run("third", "2", "2", &["--teacher-from", from, "--seed", "3"]);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success() && err.contains("none of its teacher data"), "{err}");
    assert!(!third.exists(), "no partial output");
    // Writing requests resumes from the progress a stopped run left (here one no run leaves, to see it used), and
    // the progress file goes once all are written; a damaged one is one error naming it.
    assert!(!first.join("self-prompts-progress.json").exists());
    let progress = second.join("self-prompts-progress.json");
    for (text, expected) in [
        ("not json", "self-prompts-progress.json is damaged"),
        (r#"{"attempts": 3, "requests": []}"#, "self-prompts-progress.json: 0 requests after 3 attempts is not where writing 2 in batches of 16 stops: it is damaged"),
        (r#"{"attempts": 16, "requests": ["made up"]}"#, ""),
    ] {
        for part in ["self-prompts.json", "self-prompts.safetensors"] {
            std::fs::remove_file(second.join(part)).unwrap();
        }
        std::fs::write(&progress, text).unwrap();
        let (done, _) = run_with("second", "3", "2", "2", &[]);
        let err = String::from_utf8_lossy(&done.stderr);
        if expected.is_empty() {
            assert!(done.status.success() && !progress.exists(), "{err}");
        } else {
            assert!(!done.status.success() && err.contains(expected) && err.lines().count() == 1, "{err}");
            std::fs::copy(first.join("self-prompts.json"), second.join("self-prompts.json")).unwrap();
            std::fs::copy(first.join("self-prompts.safetensors"), second.join("self-prompts.safetensors")).unwrap();
        }
    }
    let requests: Vec<String> = serde_json::from_slice(&bytes(second.join("self-prompts.json"))).unwrap();
    assert!(requests.len() == 2 && requests[0] == "made up" && !requests[1..].contains(&"made up".to_string()), "{requests:?}");
    // A damaged request file in a folder stops the run with one error naming it.
    for (text, expected) in [
        ("not json", "self-prompts.json is damaged"),
        (r#"["one", "two", "three"]"#, "holds 3 requests, more than 2: it is damaged"),
        (r#"["one request"]"#, "its request 1 is not the one the target writes now: it is damaged"),
    ] {
        std::fs::write(second.join("self-prompts.json"), text).unwrap();
        let (done, _) = run("second", "3", "2", &[]);
        let err = String::from_utf8_lossy(&done.stderr);
        // One error, after what the run said it was doing (rewriting the one request it found).
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
        assert!(!done.status.success() && errors.len() == 1 && errors[0].contains(expected) && err.trim_end().ends_with(errors[0]), "{err}");
    }
    // So does a damaged request file in the folder whose first requests are taken.
    for (i, (text, expected)) in [("not json", "self-prompts.json is damaged"), ("[]", "holds fewer than the 1 its run.json promises")].into_iter().enumerate() {
        std::fs::write(second.join("self-prompts.json"), text).unwrap();
        let (done, _) = run_with(&format!("taker{i}"), "2", "1", "1", &["--teacher-from", second.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&done.stderr);
        assert!(!done.status.success() && err.contains(expected) && err.lines().count() == 1, "{err}");
    }
    // Asking the first folder for more self-prompted conversations is another run.
    let (done, _) = run("first", "2", "3", &[]);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(!done.status.success() && err.contains("holds another training run (differs in: self_prompts)"), "{err}");
}

#[test]
fn an_eagle3_head_trains_on_an_eagle1_runs_teacher_data_and_bad_requests_for_one_are_one_error() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = twelve_line_corpus(dir.path());
    // EAGLE-3 reads three residual streams: a target of 8 layers.
    let model = tempfile::tempdir().unwrap();
    synthetic::write_model(model.path(), &Shape { layers: 8, ..Shape::tiny() }, 1, candle_core::DType::F32).unwrap();
    let (m, c) = (model.path().to_str().unwrap(), corpus.to_str().unwrap());
    let args = |target: &str, out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train-eagle", "--target", target, "--corpus", c, "--out", out.to_str().unwrap(), "--prompts", "2"].map(String::from).to_vec();
        a.extend(["--batch", "1", "--max-new-tokens", "8", "--steps", "2", "--quiet"].map(String::from));
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run = |out: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        let done = frspec().args(args(m, &out, extra)).output().unwrap();
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        out
    };
    let eagle1 = run("eagle1", &[]);
    let taken = run("taken", &["--arch", "eagle3", "--draft-vocab", "64", "--teacher-from", eagle1.to_str().unwrap()]);
    let alone = run("alone", &["--arch", "eagle3", "--draft-vocab", "64"]);
    // The EAGLE-1 run's answers, with the target's streams added by forcing them through it: byte for byte what
    // generating them with the streams records, and so the same head.
    let bytes = |p: std::path::PathBuf| std::fs::read(p).unwrap();
    for file in ["teacher.safetensors", "model.safetensors"] {
        assert_eq!(bytes(taken.join(file)), bytes(alone.join(file)), "{file}");
    }
    let target = frspec::loading::target::Target::load(m).unwrap();
    let (before, after) = (frspec::train::load_teacher(&eagle1.join("teacher.safetensors"), 64).unwrap(), frspec::train::load_teacher(&taken.join("teacher.safetensors"), 64).unwrap());
    for (b, a) in before.iter().zip(&after) {
        assert_eq!((&b.tokens, &b.features), (&a.tokens, &a.features));
        assert!(b.layers.is_empty() && a.layers.len() == 3 * a.features.len());
    }
    let draft = frspec::engine::cpu::draft::EagleDraft::load_eagle3(&taken, &target.model).unwrap();
    assert_eq!(frspec::speculative::Draft::lm_head(&draft).matrix.rows, 64);

    // Packed as heads ship, it loads the same; a head that cannot be packed, or a packed one that lacks a tensor, is
    // one error naming the file and the tensor.
    let packed = dir.path().join("packed");
    let done = frspec().args(["pack-head", taken.to_str().unwrap(), "--out", packed.to_str().unwrap()]).output().unwrap();
    assert!(done.status.success() && String::from_utf8_lossy(&done.stdout).contains("model.gguf"), "{}", String::from_utf8_lossy(&done.stderr));
    let draft = frspec::engine::cpu::draft::EagleDraft::load_eagle3(&packed, &target.model).unwrap();
    assert_eq!(frspec::speculative::Draft::lm_head(&draft).matrix.rows, 64);
    let pack_fails = |head: &Path, expected: &str| {
        let out = dir.path().join("not-packed");
        let err = fails(&["pack-head", head.to_str().unwrap(), "--out", out.to_str().unwrap()], &[]);
        assert!(err.contains(expected) && err.lines().count() == 1, "{err}");
        assert!(!out.exists(), "no partial output");
    };
    pack_fails(&eagle1.join("missing"), "missing/model.safetensors");
    let mut tensors = candle_core::safetensors::load(taken.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let fc = tensors.remove("fc.weight").unwrap();
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    std::fs::copy(taken.join("config.json"), broken.join("config.json")).unwrap();
    let integer = [("fc.weight".to_string(), fc.to_dtype(candle_core::DType::I64).unwrap())].into_iter().collect::<std::collections::HashMap<_, _>>();
    candle_core::safetensors::save(&integer, broken.join("model.safetensors")).unwrap();
    pack_fails(&broken, "model.safetensors: tensor fc.weight: I64 of shape [64, 192], not a head's weight");
    candle_core::safetensors::save(&tensors, broken.join("model.safetensors")).unwrap();
    let lacking = dir.path().join("lacking");
    assert!(frspec().args(["pack-head", broken.to_str().unwrap(), "--out", lacking.to_str().unwrap()]).status().unwrap().success());
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--draft-kind", "eagle3", "--draft", lacking.to_str().unwrap(), "--max-new-tokens", "2"], &[]);
    assert!(err.contains("lacking/model.gguf: tensor fc.weight is missing") && err.lines().count() == 1, "{err}");
    // GGUF keeps d2t as f32: offsets that are not whole numbers are one error when the head loads.
    let mut halves = candle_core::safetensors::load(taken.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    halves.insert("d2t".into(), (halves["d2t"].to_dtype(candle_core::DType::F32).unwrap() + 0.5).unwrap());
    candle_core::safetensors::save(&halves, broken.join("model.safetensors")).unwrap();
    let fractional = dir.path().join("fractional");
    assert!(frspec().args(["pack-head", broken.to_str().unwrap(), "--out", fractional.to_str().unwrap()]).status().unwrap().success());
    let err = fails(&["generate", "--model", m, "--prompt", "x", "--draft-kind", "eagle3", "--draft", fractional.to_str().unwrap(), "--max-new-tokens", "2"], &[]);
    assert!(err.contains("fractional/model.gguf: d2t holds") && err.contains(".5, not an id offset") && err.lines().count() == 1, "{err}");

    let failed = |target: &str, out: &str, extra: &[&str], expected: &str| {
        let out = dir.path().join(out);
        let a = args(target, &out, extra);
        let err = fails(&a.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        assert!(err.contains(expected) && err.lines().count() == 1, "{extra:?}: {err}");
        assert!(!out.exists(), "no partial output");
    };
    failed(m, "pruned", &["--arch", "eagle3", "--freq", "brown-smollm2", "--ratio", "0.5"], "drafts over its own draft vocabulary (--draft-vocab), not a keep set");
    failed(m, "features", &["--arch", "eagle3", "--feature-weight", "1"], "--arch eagle3 has no feature regression");
    failed(m, "vocab-eagle1", &["--draft-vocab", "64"], "--draft-vocab is the draft vocabulary of an EAGLE-3 head: it needs --arch eagle3");
    failed(m, "vocab-large", &["--arch", "eagle3", "--draft-vocab", "300"], "--draft-vocab 300 is larger than the target's vocabulary of 260");
    failed(m, "untrained", &["--arch", "eagle3", "--steps", "0"], "an untrained head needs at least one step");
    let shallow = synthetic_dir();
    failed(shallow.path().to_str().unwrap(), "shallow", &["--arch", "eagle3"], "reads three residual streams of the target, which has 2 layers (at least 4 needed)");

    // --init-from starts from a head's weights and keeps its draft vocabulary: at learning rate 0 the head comes out
    // as it went in, though another seed's teacher data would give another vocabulary.
    let t = taken.to_str().unwrap();
    let other_seed = run("other-seed", &["--arch", "eagle3", "--draft-vocab", "64", "--seed", "5"]);
    let d2t = |head: &Path| candle_core::safetensors::load(head.join("model.safetensors"), &candle_core::Device::Cpu).unwrap()["d2t"].to_vec1::<i64>().unwrap();
    assert_ne!(d2t(&other_seed), d2t(&taken));
    let restarted = run("restarted", &["--arch", "eagle3", "--seed", "5", "--lr", "0", "--init-from", t]);
    assert_eq!(bytes(restarted.join("model.safetensors")), bytes(taken.join("model.safetensors")));
    let moved = run("moved", &["--arch", "eagle3", "--seed", "5", "--init-from", t]);
    assert_eq!(d2t(&moved), d2t(&taken));
    assert_ne!(bytes(moved.join("model.safetensors")), bytes(taken.join("model.safetensors")));
    let err = fails(&args(m, &restarted, &["--arch", "eagle3", "--draft-vocab", "64", "--seed", "5", "--lr", "0"]).iter().map(String::as_str).collect::<Vec<_>>(), &[]);
    assert!(err.contains("holds another training run (differs in: init_sha256)"), "{err}");
    failed(m, "init-arch", &["--arch", "eagle3", "--init-from", eagle1.to_str().unwrap()], "eagle1/model.safetensors: an eagle1 head, but this run trains --arch eagle3");
    failed(m, "init-vocab", &["--arch", "eagle3", "--draft-vocab", "32", "--init-from", t], "--draft-vocab 32 differs from the 64 draft ids of the --init-from head");
    failed(m, "init-missing", &["--arch", "eagle3", "--init-from", eagle1.join("missing").to_str().unwrap()], "missing/model.safetensors");
    // A head packed as heads ship starts a run too: from its dequantized Q8_0 matrices, its draft vocabulary kept.
    let from_packed = run("from-packed", &["--arch", "eagle3", "--seed", "5", "--lr", "0", "--init-from", packed.to_str().unwrap()]);
    assert_eq!(d2t(&from_packed), d2t(&taken));
    let weights = |head: &Path, key: &str| candle_core::safetensors::load(head.join("model.safetensors"), &candle_core::Device::Cpu).unwrap()[key].to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for key in ["fc.weight", "lm_head.weight", "norm.weight"] {
        let (unpacked, trained) = (weights(&from_packed, key), weights(&taken, key));
        let spread = trained.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = unpacked.iter().zip(&trained).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // Norms are packed in f32, matrices in Q8_0 (a step of at most 1/127 of a block's largest value).
        let rounded = key != "norm.weight";
        assert!(worst <= spread / 127.0 && (worst > 0.0) == rounded, "{key}: {worst} of {spread}");
    }
    // With no step, --init-from writes the head as it came in (a packed one unpacked): what steps at lr 0 give.
    let no_step = |from: &Path, out: &str| {
        let out = dir.path().join(out);
        let mut a = args(m, &out, &["--arch", "eagle3", "--init-from", from.to_str().unwrap()]);
        let steps = a.iter().position(|x| x == "--steps").unwrap();
        a[steps + 1] = "0".into();
        let done = frspec().args(&a).output().unwrap();
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        bytes(out.join("model.safetensors"))
    };
    assert_eq!(no_step(&packed, "unpacked"), bytes(from_packed.join("model.safetensors")));
    assert_eq!(no_step(&taken, "as-it-came"), bytes(taken.join("model.safetensors")));
    let mut narrow = candle_core::safetensors::load(taken.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    narrow.insert("fc.weight".into(), narrow["fc.weight"].narrow(1, 0, 96).unwrap());
    candle_core::safetensors::save(&narrow, broken.join("model.safetensors")).unwrap();
    failed(m, "init-shape", &["--arch", "eagle3", "--init-from", broken.to_str().unwrap()], "broken/model.safetensors: tensor fc.weight is [64, 96], where this target's head has [64, 192]");
    // A d2t naming an id past the vocabulary, or every draft id the same target id.
    let mut beyond = d2t(&taken);
    *beyond.last_mut().unwrap() += 1000;
    for (offsets, expected) in [(beyond, "broken/model.safetensors: d2t maps draft id 63 outside the target vocabulary"), ((0..64).map(|d| -d).collect(), "broken/model.safetensors: d2t does not map the draft ids to increasing target ids")] {
        let mut bad = candle_core::safetensors::load(taken.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
        bad.insert("d2t".into(), candle_core::Tensor::new(offsets, &candle_core::Device::Cpu).unwrap());
        candle_core::safetensors::save(&bad, broken.join("model.safetensors")).unwrap();
        failed(m, "init-d2t", &["--arch", "eagle3", "--init-from", broken.to_str().unwrap()], expected);
    }
}

/// A folder with the one-line corpus train-eagle asks for (unused with --prompts 0) and where a ShareGPT file goes.
fn sharegpt_dir() -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let corpus = dir.path().join("corpus.txt");
    std::fs::write(&corpus, "the river town council voted to build a new bridge over quiet water\n").unwrap();
    let sharegpt = dir.path().join("sharegpt.json");
    (dir, corpus, sharegpt)
}

/// A ShareGPT record as the file writes it: its id and (speaker, text) turns.
fn sharegpt_record(id: &str, turns: &[(&str, &str)]) -> String {
    let turns: Vec<String> = turns.iter().map(|(from, value)| format!(r#"{{"from": "{from}", "value": "{value}"}}"#)).collect();
    format!(r#"{{"id": "{id}", "conversations": [{}]}}"#, turns.join(", "))
}

#[test]
fn sharegpt_requests_are_answered_from_a_cut_file_and_a_bad_one_is_one_error() {
    let (dir, corpus, sharegpt) = sharegpt_dir();
    // Four complete records — one opened by the model, one repeating an earlier request — and a cut one.
    let records = [
        sharegpt_record("a", &[("human", "Write a haiku."), ("gpt", "Rain.")]),
        sharegpt_record("b", &[("gpt", "Hello!"), ("human", "Hi.")]),
        sharegpt_record("c", &[("human", " Write a haiku. ")]),
        sharegpt_record("d", &[("human", "Name three rivers."), ("gpt", "Nile, Po, Rhine.")]),
    ];
    std::fs::write(&sharegpt, format!("[\n{},\n{{\"id\": \"e\", \"conversations\": [{{\"from\": \"hum", records.join(",\n"))).unwrap();
    let model = synthetic_dir();
    let (m, c, f) = (model.path().to_str().unwrap(), corpus.to_str().unwrap(), sharegpt.to_str().unwrap());
    let run = |out: &str, count: &str, extra: &[&str], envs: &[(&str, &Path)]| {
        let out = dir.path().join(out);
        let mut cmd = frspec();
        cmd.args(["train-eagle", "--target", m, "--corpus", c, "--out", out.to_str().unwrap(), "--prompts", "0", "--sharegpt", count]);
        cmd.args(["--batch", "1", "--max-new-tokens", "6", "--steps", "1"]).args(extra);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        (cmd.output().unwrap(), out)
    };
    let (done, first) = run("first", "2", &["--sharegpt-file", f], &[]);
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{said}");
    assert!(said.contains("4 complete conversations before a record cut off after") && said.contains("3 opened by a person; answering the first 2 distinct opening requests and 0 later ones"), "{said}");
    let target = frspec::loading::target::Target::load(m).unwrap();
    let convs = frspec::train::load_teacher(&first.join("sharegpt.safetensors"), target.model.config.hidden).unwrap();
    for (conv, request) in convs.iter().zip(["Write a haiku.", "Name three rivers."]) {
        let prompt = target.tokenizer.chat_prompt(&[frspec::text::chat::Message::new("user", request)]).unwrap();
        assert_eq!(conv.tokens[..conv.prompt_len], prompt[..], "{request}");
    }
    assert_eq!(convs.len(), 2);
    // The first request alone, from nothing or taken from the larger folder: the same bytes.
    let (done, alone) = run("alone", "1", &["--sharegpt-file", f], &[]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    let (done, taken) = run("taken", "1", &["--sharegpt-file", f, "--teacher-from", first.to_str().unwrap()], &[]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert_eq!(std::fs::read(taken.join("sharegpt.safetensors")).unwrap(), std::fs::read(alone.join("sharegpt.safetensors")).unwrap());
    // And the first folder's two from the one request alone, the second answered now.
    let (done, grown) = run("grown", "2", &["--sharegpt-file", f, "--teacher-from", alone.to_str().unwrap()], &[]);
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success() && said.contains("ShareGPT answers: the first 1 of 2 conversations cached"), "{said}");
    assert_eq!(std::fs::read(grown.join("sharegpt.safetensors")).unwrap(), std::fs::read(first.join("sharegpt.safetensors")).unwrap());
    // A part holding more conversations than its run asks for is damaged, not a prefix to take: one error.
    std::fs::copy(first.join("sharegpt.safetensors"), alone.join("sharegpt.safetensors")).unwrap();
    let (done, _) = run("alone", "1", &["--sharegpt-file", f], &[]);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.code() == Some(1) && err.contains("sharegpt.safetensors holds 2 conversations, more than the 1 of its run: it is damaged") && err.lines().filter(|l| l.starts_with("error")).count() == 1, "{err}");

    let failed = |out: &str, count: &str, extra: &[&str], envs: &[(&str, &Path)], expected: &[&str]| {
        let (done, out) = run(out, count, extra, envs);
        let err = String::from_utf8_lossy(&done.stderr);
        assert!(!done.status.success() && done.status.code() == Some(1) && expected.iter().all(|e| err.contains(e)), "{err}");
        assert!(!out.exists(), "no partial output");
    };
    failed("more", "3", &["--sharegpt-file", f], &[], &["sharegpt.json", "holds only 2 distinct opening requests"]);
    std::fs::write(&sharegpt, format!("[{}, {{\"id\": \"x\", \"conversations\": [{{\"from\": \"human\"}}]}}]", records[0])).unwrap();
    failed("malformed", "1", &["--sharegpt-file", f], &[], &["sharegpt.json: record 2 (at byte", "not a ShareGPT conversation", "missing field `value`"]);
    let empty_cache = tempfile::tempdir().unwrap();
    failed("no-asset", "1", &[], &[("FRSPEC_CACHE", empty_cache.path())], &["ShareGPT V3 conversations is not at", "scripts/fetch-assets.sh sharegpt"]);
}

#[test]
fn sharegpt_later_requests_are_answered_with_the_turns_before_them() {
    let (dir, corpus, sharegpt) = sharegpt_dir();
    // Later requests: a's two, then b's one (the same words as a's first, after another exchange); none from c, which
    // the model opens; none from d, whose conversation is longer than 512 tokens before its first later request.
    let long = (0..600).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let records = [
        sharegpt_record("a", &[("human", "Write a haiku."), ("gpt", "Rain."), ("human", "Another one."), ("gpt", "Snow."), ("human", " Shorter. ")]),
        sharegpt_record("b", &[("human", "Name three rivers."), ("gpt", "Nile, Po, Rhine."), ("human", "Another one.")]),
        sharegpt_record("c", &[("gpt", "Hello!"), ("human", "Hi."), ("gpt", "Hi!"), ("human", "Bye.")]),
        sharegpt_record("d", &[("human", "Read this."), ("gpt", &long), ("human", "Summarise it.")]),
    ];
    std::fs::write(&sharegpt, format!("[\n{}\n]", records.join(",\n"))).unwrap();
    let model = synthetic_dir();
    let (m, c, f) = (model.path().to_str().unwrap(), corpus.to_str().unwrap(), sharegpt.to_str().unwrap());
    let run = |out: &str, openings: &str, later: &str, extra: &[&str]| {
        let out = dir.path().join(out);
        let mut cmd = frspec();
        cmd.args(["train-eagle", "--target", m, "--corpus", c, "--out", out.to_str().unwrap(), "--prompts", "0", "--sharegpt-file", f]);
        cmd.args(["--sharegpt", openings, "--sharegpt-follow-ups", later, "--batch", "1", "--max-new-tokens", "6", "--steps", "1"]).args(extra);
        (cmd.output().unwrap(), out)
    };
    let (done, all) = run("all", "1", "3", &[]);
    let said = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success() && said.contains("answering the first 1 distinct opening requests and 3 later ones"), "{said}");
    let target = frspec::loading::target::Target::load(m).unwrap();
    let message = |role: &str, text: &str| frspec::text::chat::Message::new(role, text);
    let chats = [
        vec![message("user", "Write a haiku."), message("assistant", "Rain."), message("user", "Another one.")],
        vec![message("user", "Write a haiku."), message("assistant", "Rain."), message("user", "Another one."), message("assistant", "Snow."), message("user", "Shorter.")],
        vec![message("user", "Name three rivers."), message("assistant", "Nile, Po, Rhine."), message("user", "Another one.")],
    ];
    let convs = frspec::train::load_teacher(&all.join("sharegpt-follow-ups.safetensors"), target.model.config.hidden).unwrap();
    assert_eq!(convs.len(), 3);
    for (conv, chat) in convs.iter().zip(&chats) {
        assert_eq!(conv.tokens[..conv.prompt_len], target.tokenizer.chat_prompt(chat).unwrap()[..], "{chat:?}");
        assert!(conv.tokens.len() > conv.prompt_len);
    }
    assert_eq!(frspec::train::load_teacher(&all.join("sharegpt.safetensors"), target.model.config.hidden).unwrap().len(), 1);
    // Later requests alone, from nothing or the first of the larger folder's: the same bytes.
    let (done, alone) = run("alone", "0", "2", &[]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert!(!alone.join("sharegpt.safetensors").exists());
    let (done, taken) = run("taken", "0", "2", &["--teacher-from", all.to_str().unwrap()]);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    assert_eq!(std::fs::read(taken.join("sharegpt-follow-ups.safetensors")).unwrap(), std::fs::read(alone.join("sharegpt-follow-ups.safetensors")).unwrap());

    let (done, more) = run("more", "0", "4", &[]);
    let err = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.code() == Some(1) && err.contains("sharegpt.json: the ShareGPT file holds only 3 distinct later requests whose conversation so far is at most 512 tokens, not 4"), "{err}");
    assert!(!more.exists(), "no partial output");
}

#[test]
fn comparing_folders_that_hold_no_sweep() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let err = fails(&["compare", d, d], &[]);
    assert!(err.contains("holds no runs.parquet: is it a sweep folder?"), "{err}");
    std::fs::write(dir.path().join("runs.parquet"), "not parquet").unwrap();
    let err = fails(&["compare", d, d], &[]);
    assert!(err.contains("runs.parquet is not a readable Parquet file"), "{err}");
    // --pair needs two ratios, each in [0, 1).
    for (pair, expected) in [("0.5", "`0.5` is not BASE=OTHER (two ratios)"), ("0=1.5", "pruning ratio must be in [0, 1), got 1.5")] {
        let err = fails(&["compare", d, d, "--pair", pair], &[]);
        assert!(err.contains(expected), "{pair}: {err}");
    }
}

#[test]
fn unknown_activations_mode() {
    let dir = tempfile::tempdir().unwrap();
    let err = fails(&["score", "--model", "smollm2", "--tokens-file", &tokens_file(dir.path())], &[("FRSPEC_ACTIVATIONS", Path::new("int4"))]);
    assert!(err.contains("FRSPEC_ACTIVATIONS is `int4`: expected f32, kquants or q8"), "{err}");
    let out = dir.path().join("sweep");
    let err = fails(&["sweep", "--num-prompts", "1", "--out", out.to_str().unwrap()], &[("FRSPEC_ACTIVATIONS", Path::new("q4"))]);
    assert!(err.contains("FRSPEC_ACTIVATIONS is `q4`"), "{err}");
    assert!(!out.exists(), "a refused sweep left a folder");
}
