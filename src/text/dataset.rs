//! Prompt datasets: JSON-lines files in FastChat / Spec-Bench form (`turns`) or HuggingFaceH4 form (`prompt`),
//! from a named asset (`mt-bench`), a local file, or a hub dataset repo (`org/name[@rev][:file]`).

use crate::loading::assets;
use crate::loading::hub::{Hub, RepoId, RepoKind};
use anyhow::{anyhow, bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Question {
    pub id: String,
    pub category: Option<String>,
    pub turns: Vec<String>,
}

/// The default file of a hub dataset repo.
const DEFAULT_FILE: &str = "question.jsonl";

/// The local file a dataset spec names.
pub fn resolve(spec: &str) -> Result<PathBuf> {
    if let Some(found) = assets::local(spec) {
        return found;
    }
    let (repo, file) = spec.split_once(':').unwrap_or((spec, DEFAULT_FILE));
    let Some(repo) = RepoId::parse(repo) else {
        bail!("dataset {spec}: no such file, and not a hub dataset id (org/name[@revision][:file])");
    };
    Hub::from_env().file(RepoKind::Dataset, &repo, file)
}

pub fn load(spec: &str) -> Result<Vec<Question>> {
    let path = resolve(spec)?;
    parse(&std::fs::read_to_string(&path).with_context(|| format!("cannot read dataset {}", path.display()))?, &path)
}

pub fn parse(text: &str, path: &Path) -> Result<Vec<Question>> {
    let mut out = Vec::new();
    let mut lines_of_ids = std::collections::HashMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| anyhow!("{}: not valid JSON: {e}", at()))?;
        let turns = v
            .get("turns")
            .or_else(|| v.get("prompt"))
            .ok_or_else(|| anyhow!("{}: no `turns` (FastChat, Spec-Bench) or `prompt` (H4) field", at()))?;
        let turns: Vec<String> = match turns {
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a
                .iter()
                .map(|t| t.as_str().map(String::from).ok_or_else(|| anyhow!("{}: a turn is not a string", at())))
                .collect::<Result<_>>()?,
            _ => bail!("{}: `turns` must be a list of strings", at()),
        };
        if turns.is_empty() {
            bail!("{}: the question has no turns", at());
        }
        let id = match v.get("question_id").or_else(|| v.get("prompt_id")) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => (out.len() + 1).to_string(),
        };
        // A question is one unit of the bootstrap over prompts: one that came twice would count twice and narrow
        // every interval.
        if let Some(first) = lines_of_ids.insert(id.clone(), i + 1) {
            bail!("{}: question id {id} is already the id of line {first}", at());
        }
        let category = v.get("category").and_then(|c| c.as_str()).map(String::from);
        out.push(Question { id, category, turns });
    }
    if out.is_empty() {
        bail!("dataset {} holds no questions", path.display());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fastchat_and_h4_forms_and_names_the_bad_line() {
        let p = Path::new("d.jsonl");
        let q = parse("{\"question_id\": 81, \"category\": \"writing\", \"turns\": [\"a\", \"b\"]}\n\n{\"prompt\": [\"c\"], \"prompt_id\": \"x\"}\n", p).unwrap();
        assert_eq!(q[0], Question { id: "81".into(), category: Some("writing".into()), turns: vec!["a".into(), "b".into()] });
        assert_eq!(q[1].id, "x");
        let err = parse("{\"turns\": [\"a\"]}\n{oops\n", p).unwrap_err().to_string();
        assert!(err.contains("d.jsonl line 2") && err.contains("not valid JSON"), "{err}");
        let err = parse("{\"text\": \"a\"}\n", p).unwrap_err().to_string();
        assert!(err.contains("line 1") && err.contains("no `turns`"), "{err}");
        assert!(parse("\n", p).unwrap_err().to_string().contains("no questions"));
    }
}
