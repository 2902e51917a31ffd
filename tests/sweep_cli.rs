//! `frspec sweep` end to end on a tiny synthetic target and draft model: the files, their schema and counts,
//! byte-identical reruns, kill -9 and --resume, and the folder guard.

mod common;
use common::frspec;
use frspec::synthetic::{self, Shape};
use frspec::vocab::Frequencies;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

struct Fixture {
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new(prompts: usize) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write_model(&dir.path().join("target"), &Shape::tiny(), 1, candle_core::DType::F32).unwrap();
        synthetic::write_model(&dir.path().join("draft"), &Shape::tiny(), 2, candle_core::DType::F32).unwrap();
        let counts: Vec<u64> = (0..Shape::tiny().vocab as u64).map(|i| (i * 31) % 89).collect();
        Frequencies::from_counts(&counts, Path::new("synthetic")).save(&dir.path().join("freq.safetensors")).unwrap();
        let categories = ["writing", "math"];
        let lines: Vec<String> = (0..prompts)
            .map(|i| {
                serde_json::json!({"question_id": 81 + i, "category": categories[i % 2], "turns": [format!("tell me {i}"), format!("more {i}")]})
                    .to_string()
            })
            .collect();
        std::fs::write(dir.path().join("questions.jsonl"), lines.join("\n")).unwrap();
        Fixture { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// A sweep command writing into `out` with the draft model, with extra flags.
    fn sweep(&self, out: &Path, extra: &[&str]) -> Command {
        self.sweep_drafting(out, &["--draft", &self.path("draft"), "--draft-kind", "model"], extra)
    }

    /// A sweep command writing into `out` with the draft `draft` names, with extra flags.
    fn sweep_drafting(&self, out: &Path, draft: &[&str], extra: &[&str]) -> Command {
        self.sweep_of(&self.path("target"), out, draft, extra)
    }

    /// `sweep_drafting` with another target.
    fn sweep_of(&self, target: &str, out: &Path, draft: &[&str], extra: &[&str]) -> Command {
        let mut cmd = frspec();
        cmd.args(["sweep", "--model", target]);
        cmd.args(draft);
        cmd.args(["--freq", &self.path("freq.safetensors"), "--dataset", &self.path("questions.jsonl")]);
        cmd.args(["--k", "3", "--draft-mode", "sample", "--seed", "7", "--quiet", "--out", out.to_str().unwrap()]);
        cmd.args(extra);
        cmd
    }
}

fn ok(mut cmd: Command) -> String {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "sweep failed: {stderr}");
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn bytes(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(file).display()))
}

const SMALL: [&str; 12] =
    ["--ratios", "0,0.5", "--temperatures", "0,1", "--repeats", "2", "--num-prompts", "3", "--turns", "2", "--max-new-tokens", "8"];

#[test]
fn writes_the_tables_with_their_schema_and_counts_and_repeats_them_byte_for_byte() {
    let f = Fixture::new(4);
    let (a, b) = (f.dir.path().join("a"), f.dir.path().join("b"));
    let stdout = ok(f.sweep(&a, &SMALL));
    assert!(stdout.contains("mean acceptance length") && stdout.contains("vanilla"), "{stdout}");
    ok(f.sweep(&b, &SMALL));
    for file in ["runs.parquet", "summary.parquet"] {
        assert!(bytes(&a, file) == bytes(&b, file), "{file} differs between two runs with the same seed");
    }

    let runs = frspec::outputs::store::read(&a.join("runs.parquet")).unwrap();
    assert_eq!(runs.height(), 2 * 2 * 2 * 3 * 2, "ratios × temperatures × repeats × prompts × turns");
    let names: Vec<String> = runs.get_column_names().iter().map(|n| n.to_string()).collect();
    for col in ["ratio", "kept", "temperature", "repeat", "question_id", "category", "turn", "drafts", "draft_tokens", "accepted",
        "expected_accepted", "accepted_pos1", "accepted_pos3", "stop"] {
        assert!(names.iter().any(|n| n == col), "runs.parquet lacks {col}: {names:?}");
    }
    let summary = frspec::outputs::store::read(&a.join("summary.parquet")).unwrap();
    assert_eq!(summary.height(), 4, "one row per ratio × temperature");
    // Pooled counts in the summary are the sums of the runs', and the vanilla row's difference is zero.
    let col_u64 = |df: &polars::prelude::DataFrame, c: &str| df.column(c).unwrap().u64().unwrap().into_no_null_iter().collect::<Vec<u64>>();
    let col_f64 = |df: &polars::prelude::DataFrame, c: &str| df.column(c).unwrap().f64().unwrap().into_no_null_iter().collect::<Vec<f64>>();
    assert_eq!(col_u64(&summary, "accepted").iter().sum::<u64>(), col_u64(&runs, "accepted").iter().sum::<u64>());
    assert_eq!(col_u64(&summary, "drafts").iter().sum::<u64>(), col_u64(&runs, "drafts").iter().sum::<u64>());
    let (ratio, diff) = (col_f64(&summary, "ratio"), col_f64(&summary, "mean_acceptance_length_diff"));
    assert!(ratio.iter().zip(&diff).filter(|(r, _)| **r == 0.0).all(|(_, d)| *d == 0.0));
    for (lo, (v, hi)) in col_f64(&summary, "acceptance_rate_boot_lo")
        .iter()
        .zip(col_f64(&summary, "acceptance_rate").iter().zip(col_f64(&summary, "acceptance_rate_boot_hi")))
    {
        assert!(*lo <= *v && *v <= hi, "{lo} ≤ {v} ≤ {hi}");
    }
    assert_eq!(frspec::outputs::store::read(&a.join("timings.parquet")).unwrap().height(), runs.height());
    assert_eq!(frspec::outputs::store::read(&a.join("timing_summary.parquet")).unwrap().height(), 4);

    let manifest: serde_json::Value = serde_json::from_slice(&bytes(&a, "manifest.json")).unwrap();
    assert_eq!(manifest["settings"]["repeats"], 2);
    assert_eq!(manifest["files"]["model"]["sha256"].as_str().unwrap().len(), 64);
    assert!(manifest["files"]["draft"].is_object() && manifest["files"]["freq"].is_object() && manifest["files"]["dataset"].is_object());
    assert!(manifest["crates"]["polars"].is_string() && manifest["crates"]["candle-core"].is_string(), "{manifest}");
    assert!(manifest["git_commit"].is_string() && manifest["hardware"]["threads"].as_u64().unwrap() >= 1);
    assert_eq!((manifest["units_total"].as_u64(), manifest["units_resumed"].as_u64()), (Some(3 + 3 * 2), Some(0)));

    // `frspec compare` pairs two sweeps cell by cell: the same sweep twice differs by nothing on any prompt.
    let mut compare = frspec();
    compare.args(["compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    let table = ok(compare);
    assert_eq!(table.lines().count(), 2 + 4, "{table}");
    assert!(table.lines().skip(2).all(|l| l.contains("| +0.000 [+0.000, +0.000] |") && l.ends_with("| 0 / 0 |")), "{table}");
    // By category: each cell's row, then writing (prompts 81 and 83) and math (82), in the dataset's order.
    let mut compare = frspec();
    compare.args(["compare", a.to_str().unwrap(), b.to_str().unwrap(), "--by-category"]);
    let table = ok(compare);
    let categories: Vec<(&str, &str)> = table.lines().skip(2).map(|l| { let c: Vec<&str> = l.split(" | ").collect(); (c[2], c[3]) }).collect();
    assert_eq!(categories, [("all", "3"), ("writing", "2"), ("math", "1")].repeat(4), "{table}");
    assert!(table.lines().skip(2).all(|l| l.contains("| +0.000 [+0.000, +0.000] |")), "{table}");
    // Read back, the runs give the summary's paired differences: ratio 0.5 against ratio 0, as if two sweeps.
    use frspec::outputs::{compare, store::RunCounts};
    let runs = compare::runs(&a).unwrap();
    assert_eq!(runs.len(), runs_height(&a));
    let at = |ratio: f64| runs.iter().filter(|r| r.ratio == ratio).map(|r| RunCounts { ratio: 0.0, ..r.clone() }).collect::<Vec<_>>();
    let rows = compare::compare(&at(0.0), &at(0.5), &[], false, frspec::stats::Bootstrap::default()).unwrap();
    let temperature: Vec<f32> = summary.column("temperature").unwrap().f32().unwrap().into_no_null_iter().collect();
    assert_eq!(rows.len(), 2);
    for row in rows {
        let i = (0..ratio.len()).find(|&i| ratio[i] == 0.5 && temperature[i] == row.temperature).unwrap();
        assert!((row.difference.value - diff[i]).abs() < 1e-12, "T = {}: {} against the summary's {}", row.temperature, row.difference.value, diff[i]);
    }
}

fn runs_height(dir: &Path) -> usize {
    frspec::outputs::store::read(&dir.join("runs.parquet")).unwrap().height()
}

#[test]
fn kill_9_then_resume_gives_the_uninterrupted_tables_and_the_folder_guards_its_sweep() {
    let f = Fixture::new(8);
    let args = ["--ratios", "0,0.5,0.9", "--temperatures", "0,1", "--repeats", "3", "--turns", "1", "--max-new-tokens", "24"];
    let whole = f.dir.path().join("whole");
    ok(f.sweep(&whole, &args));

    // Units: 8 greedy + 8 × 3 sampled. Kill after a random number of them, at a random moment within the next.
    let units = 8 + 8 * 3;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as usize;
    let kill_after = 1 + nanos % (units - 3);
    let killed = f.dir.path().join("killed");
    let mut child = f.sweep(&killed, &args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let journal = killed.join("units");
    let finished = |p: &PathBuf| std::fs::read_dir(p).map_or(0, |d| d.filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "json")).count().saturating_sub(1));
    while finished(&journal) < kill_after {
        assert!(child.try_wait().unwrap().is_none(), "the sweep ended before it was killed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_micros((nanos % 20_000) as u64));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!killed.join("summary.parquet").exists(), "killed after {kill_after} units, but the sweep had finished");

    // The folder refuses a fresh start and other arguments, then resumes.
    let refused = f.sweep(&killed, &args).output().unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("--resume"), "{err}");
    let longer: Vec<&str> = args.iter().map(|a| if *a == "24" { "25" } else { a }).collect();
    let mut other = f.sweep(&killed, &longer);
    other.arg("--resume");
    let refused = other.output().unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("max_new_tokens: 24 → 25"), "{err}");

    let mut resume = f.sweep(&killed, &args);
    resume.arg("--resume");
    ok(resume);
    for file in ["runs.parquet", "summary.parquet"] {
        assert!(bytes(&whole, file) == bytes(&killed, file), "{file} after kill -9 at unit {kill_after} + resume differs");
    }
    let manifest: serde_json::Value = serde_json::from_slice(&bytes(&killed, "manifest.json")).unwrap();
    assert!(manifest["units_resumed"].as_u64().unwrap() >= kill_after as u64);

    let mut overwrite = f.sweep(&killed, &args);
    overwrite.args(["--overwrite", "--seed", "8"]);
    ok(overwrite);
    assert!(bytes(&whole, "runs.parquet") != bytes(&killed, "runs.parquet"), "another seed, other sampled records");
}

/// A copy of sweep `from`'s summary and manifest in a folder of the fixture called `name` (`check --update-baseline`).
fn baseline_of(f: &Fixture, from: &Path, name: &str) -> std::path::PathBuf {
    let dir = f.dir.path().join(name);
    let update = frspec().args(["check", "--update-baseline", "--baseline", dir.to_str().unwrap(), "--current", from.to_str().unwrap()]).output().unwrap();
    assert!(update.status.success(), "{}", String::from_utf8_lossy(&update.stderr));
    dir
}

/// `frspec check` with its exit code and output.
fn check(baseline: &Path, current: &Path) -> (Option<i32>, String, String) {
    let out = frspec().args(["check", "--baseline", baseline.to_str().unwrap(), "--current", current.to_str().unwrap()]).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn check_passes_its_own_baseline_fails_a_doctored_one_and_refuses_what_it_cannot_compare() {
    let f = Fixture::new(4);
    let (a, b) = (f.dir.path().join("a"), f.dir.path().join("b"));
    ok(f.sweep(&a, &SMALL));
    ok(f.sweep(&b, &SMALL));
    let (code, stdout, _) = check(&a, &b);
    assert_eq!(code, Some(0), "{stdout}");
    assert_eq!(stdout.matches(" ok").count(), 4 * 2, "4 cells × 2 metrics: {stdout}");

    // Raise the baseline's T = 1, ratio 0.5 length far above anything its interval allows.
    let doctored = baseline_of(&f, &a, "doctored");
    let summary = doctored.join("summary.parquet");
    let mut cells = frspec::outputs::store::read_summary(&summary).unwrap();
    let cell = cells.iter_mut().find(|c| c.ratio == 0.5 && c.temperature == 1.0).unwrap();
    cell.length.value += 1.0;
    cell.length.bootstrap.lo += 1.0;
    cell.length.bootstrap.hi += 1.0;
    frspec::outputs::store::write_summary(&summary, &cells).unwrap();
    let (code, stdout, stderr) = check(&doctored, &b);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    let flagged: Vec<&str> = stdout.lines().filter(|l| l.contains("REGRESSED")).collect();
    assert_eq!(flagged.len(), 1, "{stdout}");
    assert!(flagged[0].contains("0.5") && flagged[0].contains("mean acceptance length") && flagged[0].contains("-1.000"), "{stdout}");
    assert!(stderr.contains("regression: 1 of 8"), "{stderr}");

    // A NaN is a regression, never a pass.
    let nan = baseline_of(&f, &a, "nan");
    let mut cells = frspec::outputs::store::read_summary(&nan.join("summary.parquet")).unwrap();
    cells[0].length.value = f64::NAN;
    frspec::outputs::store::write_summary(&nan.join("summary.parquet"), &cells).unwrap();
    let (code, stdout, stderr) = check(&a, &nan);
    assert_eq!(code, Some(1), "{stdout}{stderr}");
    assert_eq!(stdout.lines().filter(|l| l.contains("REGRESSED")).count(), 1, "{stdout}");

    // Manifests that lack a compared setting or an input's digest are refused, even when both lack the same.
    for (name, strip) in [("no-k", &["settings", "k"][..]), ("no-digest", &["files", "model", "sha256"][..])] {
        let (x, y) = (baseline_of(&f, &a, &format!("{name}-x")), baseline_of(&f, &a, &format!("{name}-y")));
        for dir in [&x, &y] {
            let path = dir.join("manifest.json");
            let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            let (field, parents) = strip.split_last().unwrap();
            parents.iter().fold(&mut manifest, |m, key| &mut m[*key]).as_object_mut().unwrap().remove(*field);
            std::fs::write(&path, manifest.to_string()).unwrap();
        }
        let (code, _, stderr) = check(&x, &y);
        assert_eq!(code, Some(2), "{name}: {stderr}");
        assert!(stderr.contains(&format!("its manifest lacks {}", strip.join("."))), "{name}: {stderr}");
    }

    // Batch sizes, written by the candle engine, must agree when both sweeps have one; one side alone compares.
    let batched = |name: &str, batch: Option<u64>| {
        let dir = baseline_of(&f, &a, name);
        let path = dir.join("manifest.json");
        let mut manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        if let Some(b) = batch {
            manifest["settings"]["batch"] = b.into();
        }
        std::fs::write(&path, manifest.to_string()).unwrap();
        dir
    };
    let (b8, b64, unbatched) = (batched("batch-8", Some(8)), batched("batch-64", Some(64)), batched("no-batch", None));
    let (code, _, stderr) = check(&b8, &b64);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("batch: baseline 8, current 64"), "{stderr}");
    assert_eq!(check(&unbatched, &b64).0, Some(0));

    // Unusable: other settings, missing cells, no summary, a corrupt summary.
    let longer = f.dir.path().join("longer");
    let args: Vec<&str> = SMALL.iter().map(|a| if *a == "8" { "9" } else { a }).collect();
    ok(f.sweep(&longer, &args));
    let (code, _, stderr) = check(&a, &longer);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("different settings") && stderr.contains("max_new_tokens: baseline 8, current 9"), "{stderr}");
    let fewer = f.dir.path().join("fewer");
    let args: Vec<&str> = SMALL.iter().map(|a| if *a == "0,0.5" { "0" } else { a }).collect();
    ok(f.sweep(&fewer, &args));
    let (code, _, stderr) = check(&a, &fewer);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("lacks cells the baseline has: ratio 0.5 at T=0, ratio 0.5 at T=1"), "{stderr}");
    let (code, _, stderr) = check(&a, f.dir.path());
    assert_eq!(code, Some(2));
    assert!(stderr.contains("holds no summary.parquet"), "{stderr}");
    std::fs::write(b.join("summary.parquet"), b"PAR1 not really").unwrap();
    let (code, _, stderr) = check(&a, &b);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("summary.parquet is not a readable Parquet file"), "{stderr}");
}

#[test]
fn a_sweep_on_the_candle_engine_passes_check_against_the_cpu_engines_and_reruns_byte_for_byte() {
    let f = Fixture::new(4);
    let (cpu, a, b) = (f.dir.path().join("cpu"), f.dir.path().join("candle-a"), f.dir.path().join("candle-b"));
    // The target's first layer drafts: accepted often, not always, so the counts say something.
    let truncated = ["--draft-kind", "truncated:1"];
    ok(f.sweep_drafting(&cpu, &truncated, &SMALL));
    let candle: Vec<&str> = SMALL.iter().copied().chain(["--engine", "candle"]).collect();
    ok(f.sweep_drafting(&a, &truncated, &candle));
    ok(f.sweep_drafting(&b, &truncated, &candle));
    for file in ["runs.parquet", "summary.parquet"] {
        assert!(bytes(&a, file) == bytes(&b, file), "{file} differs between two candle runs with the same seed");
    }
    let (code, stdout, stderr) = check(&cpu, &a);
    assert_eq!(code, Some(0), "{stdout}{stderr}");
    // At T = 0 the engines agree record for record on this model (the counts; timings differ).
    let want = t0_counts(&cpu);
    assert!(!want.is_empty() && want.iter().any(|c| c.1 > 0) && want.iter().any(|c| c.1 < 3 * c.0), "{want:?}");
    assert_eq!(t0_counts(&a), want);
    let manifest: serde_json::Value = serde_json::from_slice(&bytes(&a, "manifest.json")).unwrap();
    assert_eq!((manifest["settings"]["engine"].as_str(), manifest["hardware"]["engine"].as_str()), (Some("candle"), Some("candle")), "{manifest}");
    assert_eq!(manifest["hardware"]["dtype"].as_str(), Some("f32"));
    let cpu_manifest: serde_json::Value = serde_json::from_slice(&bytes(&cpu, "manifest.json")).unwrap();
    assert!(cpu_manifest["settings"].get("engine").is_none(), "the CPU engine leaves the settings as before engines existed");

    // A folder belongs to its engine: resuming it on the other is refused, and bad engine settings are too.
    let resume: Vec<&str> = candle.iter().copied().chain(["--resume"]).collect();
    let out = f.sweep_drafting(&cpu, &truncated, &resume).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("engine"), "{}", String::from_utf8_lossy(&out.stderr));
    for (flags, message) in [
        (&["--engine", "cpu", "--dtype", "bf16"][..], "dtype bf16: the cpu engine computes activations in f32"),
        (&["--engine", "cpu", "--device", "cuda"], "device cuda: the cpu engine runs on the CPU"),
        (&["--engine", "candle", "--dtype", "f64"], "--dtype f64: expected f32, f16 or bf16"),
        (&["--device", "tpu"], "--device tpu: expected cpu, cuda or cuda:N"),
    ] {
        let out_dir = f.dir.path().join("refused");
        let args: Vec<&str> = SMALL.iter().copied().chain(flags.iter().copied()).collect();
        let out = f.sweep(&out_dir, &args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{flags:?}: {stderr}");
        assert!(stderr.contains(message), "{flags:?}: {stderr}");
        assert!(!out_dir.exists(), "{flags:?}: a refused sweep leaves no folder");
    }
}

/// (drafts, accepted, generated) of every T = 0 record of the sweep in `dir`, in table order.
fn t0_counts(dir: &Path) -> Vec<(u64, u64, u64)> {
    let runs = frspec::outputs::store::read(&dir.join("runs.parquet")).unwrap();
    let t0 = runs.column("temperature").unwrap().f32().unwrap().into_no_null_iter().map(|t| t == 0.0).collect::<Vec<_>>();
    let col = |c: &str| runs.column(c).unwrap().u64().unwrap().into_no_null_iter().collect::<Vec<u64>>();
    let (drafts, accepted, generated) = (col("drafts"), col("accepted"), col("generated"));
    (0..runs.height()).filter(|&i| t0[i]).map(|i| (drafts[i], accepted[i], generated[i])).collect()
}

#[test]
fn eagle_heads_built_from_a_synthetic_target_draft_well_and_sweep_alike_on_both_engines() {
    // gpu-check.sh compares EAGLE drafts fed together on the GPU with the CPU engine's through such heads (a GPU
    // machine has no real weights); here the candle engine on the CPU device stands in for the GPU.
    let f = Fixture::new(3);
    let (target, eagle1, eagle3) = (f.path("target4"), f.path("eagle1"), f.path("eagle3"));
    let mut make = frspec();
    make.args(["synthetic-model", "--out", &target, "--hidden", "64", "--layers", "4", "--vocab", "260", "--seed", "1"]);
    make.args(["--eagle-head", &eagle1, "--eagle3-head", &eagle3]);
    ok(make);
    for (kind, head) in [("eagle", &eagle1), ("eagle3", &eagle3)] {
        let draft = ["--draft-kind", kind, "--draft", head];
        let (cpu, candle) = (f.dir.path().join(format!("{kind}-cpu")), f.dir.path().join(format!("{kind}-candle")));
        ok(f.sweep_of(&target, &cpu, &draft, &SMALL));
        let on_candle: Vec<&str> = SMALL.iter().copied().chain(["--engine", "candle"]).collect();
        ok(f.sweep_of(&target, &candle, &draft, &on_candle));
        let (code, stdout, stderr) = check(&cpu, &candle);
        assert_eq!(code, Some(0), "{kind}: {stdout}{stderr}");
        let want = t0_counts(&cpu);
        // What the heads are built for: a random head's drafts are almost never accepted (then any two engines'
        // records agree); these are, at a fifth of the draft steps or more.
        let (drafts, accepted) = want.iter().fold((0, 0), |(d, a), c| (d + c.0, a + c.1));
        assert!(accepted * 5 >= drafts && want.iter().any(|c| c.1 < 3 * c.0), "{kind}: {want:?}");
        assert_eq!(t0_counts(&candle), want, "{kind}");
    }
}

#[test]
fn a_draft_model_narrower_than_the_target_sweeps_on_both_engines() {
    // The draft head's timing probe is the head's own width, not the target's (it panicked on the CPU engine).
    let f = Fixture::new(3);
    let narrow = Shape { hidden: 32, intermediate: 64, heads: 2, kv_heads: 1, ..Shape::tiny() };
    synthetic::write_model(&f.dir.path().join("narrow"), &narrow, 3, candle_core::DType::F32).unwrap();
    let draft = ["--draft", &f.path("narrow"), "--draft-kind", "model"];
    for engine in ["cpu", "candle"] {
        let out = f.dir.path().join(engine);
        let args: Vec<&str> = SMALL.iter().copied().chain(["--engine", engine]).collect();
        ok(f.sweep_drafting(&out, &draft, &args));
        assert_eq!(frspec::outputs::store::read(&out.join("timing_summary.parquet")).unwrap().height(), 4, "{engine}");
    }
}

#[test]
fn plots_and_report_of_a_sweep() {
    let f = Fixture::new(4);
    let a = f.dir.path().join("a");
    ok(f.sweep(&a, &SMALL));
    let out = frspec().args(["plot", a.to_str().unwrap()]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for name in frspec::outputs::plot::CHARTS {
        let png = bytes(&a.join("plots"), &format!("{name}.png"));
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{name}.png: {} bytes", png.len());
        let svg = String::from_utf8(bytes(&a.join("plots"), &format!("{name}.svg"))).unwrap();
        assert!(svg.contains("<svg") && svg.contains("draft model") && svg.contains("ratio"), "{name}.svg");
    }
    let report = ok({
        let mut c = frspec();
        c.args(["report", a.to_str().unwrap()]);
        c
    });
    assert!(report.contains("| ratio | vanilla | 0.5 |") && report.contains("| T=1 mean acceptance length |"), "{report}");
    // The fixture's prompts alternate writing and math: each gets its rows at both temperatures, in that order.
    let by_category = report.split_once("## By category").map(|(_, t)| t).unwrap_or_else(|| panic!("{report}"));
    let rows: Vec<&str> = by_category.lines().filter(|l| l.starts_with("| T=")).map(|l| l.split(" |").next().unwrap()).collect();
    let expected: Vec<String> = ["0", "1"]
        .iter()
        .flat_map(|t| ["writing", "math"].map(|c| [format!("| T={t} {c} mean acceptance length"), format!("| T={t} {c} Δ length vs vanilla")]))
        .flatten()
        .collect();
    assert_eq!(rows, expected, "{report}");
    let err = frspec().args(["plot", f.dir.path().to_str().unwrap()]).output().unwrap();
    assert_eq!(err.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&err.stderr).contains("holds no summary.parquet"));
}

/// The default preset's full matrix, run here and committed (results/sweeps/): read back, schema and counts.
#[test]
fn the_committed_default_matrix_reads_back_whole() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("results/sweeps/smollm2-truncated16");
    let runs = frspec::outputs::store::read(&dir.join("runs.parquet")).unwrap();
    assert_eq!(runs.height(), 6 * 2 * 3 * 20, "6 ratios × T 0, 1 × 3 repeats × 20 prompts × turn 1");
    let cells = frspec::outputs::store::read_summary(&dir.join("summary.parquet")).unwrap();
    assert_eq!(cells.len(), 12);
    assert!(cells.iter().all(|c| c.prompts == 20 && c.repeats == 3 && c.runs == 60 && c.per_position.len() == 4));
    let timings = frspec::outputs::store::read_timing_summary(&dir.join("timing_summary.parquet")).unwrap();
    assert_eq!(timings.len(), 12);
    assert_eq!(frspec::outputs::store::read(&dir.join("timings.parquet")).unwrap().height(), runs.height());
    let manifest: serde_json::Value = serde_json::from_slice(&bytes(&dir, "manifest.json")).unwrap();
    assert_eq!((manifest["settings"]["preset"].as_str(), manifest["units_total"].as_u64()), (Some("smollm2-eagle"), Some(20 + 20 * 3)));
}

#[test]
fn a_damaged_journal_entry_is_redone_a_held_folder_is_refused() {
    let f = Fixture::new(4);
    let a = f.dir.path().join("a");
    ok(f.sweep(&a, &SMALL));
    let runs = bytes(&a, "runs.parquet");

    // One damaged entry and one stray file: --resume redoes that unit and says so, and the tables come out the same.
    let mut entries: Vec<PathBuf> = std::fs::read_dir(a.join("units")).unwrap().map(|e| e.unwrap().path()).collect();
    entries.sort();
    let damaged = entries.iter().find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("t0-")).unwrap().clone();
    std::fs::write(&damaged, b"{ not a unit").unwrap();
    std::fs::write(a.join("units").join("t9-stray.json"), b"{}").unwrap();
    let out = f.sweep(&a, &[&SMALL[..], &["--resume"]].concat()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let name = damaged.file_name().unwrap().to_str().unwrap();
    assert!(stderr.contains(&format!("note: redoing {name}")) && stderr.contains("t9-stray.json: not a unit of this sweep"), "{stderr}");
    assert!(stderr.contains("1 units run, "), "only the damaged unit reran: {stderr}");
    assert_eq!(bytes(&a, "runs.parquet"), runs);

    // While a sweep holds the folder, another one cannot write it.
    let lock = std::fs::File::open(a.join("units").join("lock")).unwrap();
    lock.lock().unwrap();
    let out = f.sweep(&a, &[&SMALL[..], &["--resume"]].concat()).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(1) && stderr.contains("is being written by another sweep"), "{stderr}");
    drop(lock);

    // An --out that cannot be read as a folder is not taken for an empty one.
    let file = f.dir.path().join("a-file");
    std::fs::write(&file, "mine").unwrap();
    let out = f.sweep(&file, &SMALL).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(1) && stderr.contains("cannot read --out"), "{stderr}");
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
}

/// `src` copied into `dst`, folders and all.
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let path = entry.unwrap().path();
        let to = dst.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &to);
        } else {
            std::fs::copy(&path, &to).unwrap();
        }
    }
}

#[test]
fn three_shards_merged_give_the_one_machine_tables_and_a_bad_merge_writes_nothing() {
    let f = Fixture::new(4);
    let whole = f.dir.path().join("whole");
    ok(f.sweep(&whole, &SMALL));
    let shard = |i: usize, extra: &[&str]| {
        let dir = f.dir.path().join(format!("shard{i}{}", extra.join("")));
        let mut cmd = f.sweep(&dir, &SMALL);
        cmd.args(["--shard", &format!("{i}/3")]).args(extra);
        ok(cmd);
        dir
    };
    let shards: Vec<PathBuf> = (0..3).map(|i| shard(i, &[])).collect();
    // 3 greedy units + 3 prompts × 2 repeats sampled, split three ways; a shard writes no tables of its own.
    let entries = |d: &Path| std::fs::read_dir(d.join("units")).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('t')).count();
    assert_eq!(shards.iter().map(|d| entries(d)).sum::<usize>(), 9);
    assert!(shards.iter().all(|d| entries(d) > 0 && !d.join("summary.parquet").exists()));

    let merge = |out: &Path, dirs: &[&Path]| {
        let mut cmd = frspec();
        cmd.args(["merge", "--out", out.to_str().unwrap()]).args(dirs);
        cmd.output().unwrap()
    };
    let merged = f.dir.path().join("merged");
    let all: Vec<&Path> = shards.iter().map(|d| d.as_path()).collect();
    let done = merge(&merged, &all);
    assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
    for file in ["runs.parquet", "summary.parquet"] {
        assert!(bytes(&whole, file) == bytes(&merged, file), "{file}: merged shards differ from the one-machine sweep");
    }
    let settings = |d: &Path| serde_json::from_slice::<serde_json::Value>(&bytes(d, "manifest.json")).unwrap()["settings"].clone();
    assert_eq!(settings(&merged), settings(&whole));
    assert_eq!(settings(&shards[1])["shard"], "1/3");

    // A shard resumes like any sweep, and refuses to become another shard.
    let mut again = f.sweep(&shards[0], &SMALL);
    again.args(["--shard", "0/3", "--resume"]);
    ok(again);
    let mut other = f.sweep(&shards[0], &SMALL);
    other.args(["--shard", "1/3", "--resume"]);
    let refused = other.output().unwrap();
    assert!(String::from_utf8_lossy(&refused.stderr).contains("shard: \"0/3\" → \"1/3\""), "{}", String::from_utf8_lossy(&refused.stderr));

    let lacking = f.dir.path().join("lacking");
    copy_dir(&shards[2], &lacking);
    let first_unit = |d: &Path| std::fs::read_dir(d.join("units")).unwrap().map(|e| e.unwrap().path()).find(|p| p.file_name().unwrap().to_string_lossy().starts_with('t')).unwrap();
    std::fs::remove_file(first_unit(&lacking)).unwrap();
    let damaged = f.dir.path().join("damaged");
    copy_dir(&shards[2], &damaged);
    std::fs::write(first_unit(&damaged), b"{\"key\": ").unwrap();
    let reseeded = shard(2, &["--seed", "8"]);
    let occupied = f.dir.path().join("occupied");
    std::fs::create_dir_all(&occupied).unwrap();
    std::fs::write(occupied.join("notes.txt"), "mine").unwrap();
    let (s0, s1) = (shards[0].as_path(), shards[1].as_path());
    let cases: [(&[&Path], &str); 7] = [
        (&[s0, s1], "shard 2/3 is missing"),
        (&[s0, s1, s1], "are both shard 1/3"),
        (&[s0, s1, &reseeded], "was made with other settings"),
        (&[s0, s1, &whole], "holds a whole sweep, not a shard"),
        (&[s0, s1, &lacking], "(shard 2/3) lacks 1 of its"),
        (&[s0, s1, &damaged], "is damaged"),
        (&[s0, s1, &shards[2]], "does not hold a frspec sweep"),
    ];
    for (i, (dirs, expected)) in cases.iter().enumerate() {
        let out = if i == 6 { occupied.clone() } else { f.dir.path().join(format!("bad{i}")) };
        let run = merge(&out, dirs);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.code() == Some(1) && stderr.lines().count() == 1 && stderr.contains(expected), "case {i}: {stderr}");
        assert!(i == 6 || !out.exists(), "case {i}: a failed merge left {}", out.display());
    }
    assert_eq!(std::fs::read_dir(&occupied).unwrap().count(), 1, "a failed merge wrote into a folder that was not its own");

    let mut outside = f.sweep(&f.dir.path().join("slurm"), &SMALL);
    outside.args(["--shard", "slurm"]).env_remove("SLURM_ARRAY_TASK_ID");
    let refused = outside.output().unwrap();
    assert!(String::from_utf8_lossy(&refused.stderr).contains("SLURM_ARRAY_TASK_ID is not set"));
}
