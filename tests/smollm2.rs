//! The real default target, SmolLM2-135M-Instruct (GGUF Q4_1), fetched by scripts/fetch-assets.sh.

mod common;
use common::asset;
use frspec::text::chat::Message;
use frspec::speculative::generate::generate;
use frspec::sampling::Sampling;
use frspec::loading::target::Target;
use rand::{RngExt, SeedableRng};
use std::sync::OnceLock;

fn target() -> &'static Target {
    static T: OnceLock<Target> = OnceLock::new();
    T.get_or_init(|| Target::load("smollm2").unwrap_or_else(|e| panic!("{e:#}")))
}

fn mt_bench_turns() -> Vec<(u64, Vec<String>)> {
    std::fs::read_to_string(asset("mt-bench"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let turns = v["turns"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_string()).collect();
            (v["question_id"].as_u64().unwrap(), turns)
        })
        .collect()
}

#[test]
fn answers_the_france_question() {
    // With exact activations, as HF transformers runs the model (its first token leads the next by 0.09 logits; the
    // default 8-bit activations, like llama.cpp's, tip it). In another process: the mode is chosen once per process.
    let out = common::frspec()
        .args(["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "32"])
        .env("FRSPEC_ACTIVATIONS", "f32")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap());
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout, "The capital of France is Paris.\n");
    assert!(stderr.contains("stop: EndOfTurn"), "{stderr}");
}

#[test]
fn chat_template_renders_the_default_system_prompt_without_bos() {
    let t = target();
    let text = t.tokenizer.chat_template.as_ref().unwrap().render(&[Message::new("user", "Hi")], true).unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = t.tokenizer.chat_prompt(&[Message::new("user", "Hi")]).unwrap();
    assert_eq!(t.tokenizer.token_text(ids[0]).as_deref(), Some("<|im_start|>"));
    assert!(t.tokenizer.is_stop(t.tokenizer.encode("<|im_end|>").unwrap()[0]));
}

#[test]
fn tokenizer_round_trips_every_mt_bench_turn() {
    let t = target();
    for (id, turns) in mt_bench_turns() {
        for turn in turns {
            let ids = t.tokenizer.encode(&turn).unwrap();
            assert_eq!(t.tokenizer.decode(&ids).unwrap(), turn, "question {id}");
        }
    }
}

#[test]
fn tokenizer_encodes_mt_bench_exactly_as_llama_cpp() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/datasets/fixtures/mtbench_smollm2_llamacpp_tokens.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let questions = mt_bench_turns();
    let expected = fixture["questions"].as_array().unwrap();
    assert_eq!(expected.len(), questions.len());
    let t = target();
    for ((id, turns), e) in questions.iter().zip(expected) {
        assert_eq!(e["question_id"].as_u64(), Some(*id));
        for (turn, ids) in turns.iter().zip(e["turns"].as_array().unwrap()) {
            let want: Vec<u32> = serde_json::from_value(ids.clone()).unwrap();
            assert_eq!(t.tokenizer.encode(turn).unwrap(), want, "question {id}");
        }
    }
}

/// A chat prompt and 24 greedy tokens after it: the sequence the exactness tests run along.
fn chat_sequence() -> Vec<u32> {
    let t = target();
    let (_, turns) = &mt_bench_turns()[0];
    let mut tokens = t.tokenizer.chat_prompt(&[Message::new("user", &turns[0])]).unwrap();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(0);
    let g = generate(&t.model, &t.tokenizer.stop_ids, &tokens, 24, Sampling::GREEDY, &mut rng).unwrap();
    tokens.extend(g.tokens);
    tokens
}

#[test]
fn a_block_equals_single_token_forwards_bit_for_bit() {
    let t = target();
    let m = &t.model;
    let seq = chat_sequence();
    let split = seq.len() - 20;
    let (h, v) = (m.config.hidden, m.config.vocab);
    // Verification-sized blocks (1, 2, 5, 12) after the prompt against one token at a time.
    let mut single = m.new_cache();
    m.forward(&seq[..split], &mut single, &[], &[]).unwrap();
    let mut blocks = single.clone();
    let mut at = split;
    for size in [1, 2, 5, 12] {
        let rows: Vec<usize> = (0..size).collect();
        let block = m.forward(&seq[at..at + size], &mut blocks, &rows, &[]).unwrap();
        for i in 0..size {
            let one = m.forward(&seq[at + i..at + i + 1], &mut single, &[0], &[]).unwrap();
            assert_eq!(one.hidden, block.hidden[i * h..(i + 1) * h], "hidden at position {}", at + i);
            assert_eq!(one.logits, block.logits[i * v..(i + 1) * v], "logits at position {}", at + i);
        }
        at += size;
    }
}

#[test]
fn truncate_and_refeed_equals_the_uninterrupted_run() {
    let m = &target().model;
    let seq = chat_sequence();
    let n = seq.len();
    let rows: Vec<usize> = (0..8).collect();
    let mut straight = m.new_cache();
    m.forward(&seq[..n - 8], &mut straight, &[], &[]).unwrap();
    let mut rolled = straight.clone();
    let want = m.forward(&seq[n - 8..], &mut straight, &rows, &[]).unwrap();
    // Four wrong draft tokens are verified, rejected and dropped; then the true tokens follow.
    m.forward(&[1, 2, 3, 4], &mut rolled, &[0, 1, 2, 3], &[]).unwrap();
    rolled.truncate(n - 8);
    let got = m.forward(&seq[n - 8..], &mut rolled, &rows, &[]).unwrap();
    assert_eq!(got.hidden, want.hidden);
    assert_eq!(got.logits, want.logits);
}

#[test]
fn sampled_continuations_decoded_together_get_what_each_gets_alone() {
    let t = target();
    // What the target continues to write a request of its own (Magpie): the chat up to the user's message.
    let prefix = t.tokenizer.user_turn_prefix().unwrap();
    assert_eq!(
        t.tokenizer.decode(&prefix).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
    );
    let sampling = Sampling::new(1.0, 1.0).unwrap();
    let stream = |i: u64| {
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(3);
        rng.set_stream(i);
        rng
    };
    let alone: Vec<Vec<u32>> = (0..4).map(|i| generate(&t.model, &t.tokenizer.stop_ids, &prefix, 24, sampling, &mut stream(i)).unwrap().tokens).collect();
    let mut streams: Vec<_> = (0..4).map(stream).collect();
    let together = frspec::speculative::decode::continuations(&t.model, &t.tokenizer.stop_ids, &vec![prefix.as_slice(); 4], 24, &[], sampling, &mut |i| streams[i].random())
        .unwrap();
    for (answer, c) in alone.iter().zip(&together) {
        assert_eq!(c.tokens, [&prefix[..], &answer[..]].concat());
    }
    assert!(alone.windows(2).all(|w| w[0] != w[1]), "each stream writes its own request");
}

#[test]
fn prompts_decoded_together_get_what_each_gets_alone() {
    let t = target();
    let m = &t.model;
    let prompts: Vec<Vec<u32>> = mt_bench_turns()[..11].iter().map(|(_, turns)| t.tokenizer.chat_prompt(&[Message::new("user", &turns[0])]).unwrap()).collect();
    let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(0);
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| generate(m, &t.tokenizer.stop_ids, p, 20, Sampling::GREEDY, &mut rng).unwrap().tokens).collect();
    // A token many answers reach makes the batch shrink as they stop.
    let mut stops = t.tokenizer.stop_ids.clone();
    let reached_by = |x: &u32| alone.iter().filter(|a| a[..19].contains(x)).count();
    stops.push(*alone.concat().iter().max_by_key(|x| (reached_by(x), **x)).unwrap());
    let layers = [0, m.config.layers / 2];
    let together = frspec::speculative::decode::greedy_continuations(m, &stops, &prompts, 20, &layers).unwrap();
    let mut stopped_early = 0;
    for ((prompt, answer), c) in prompts.iter().zip(&alone).zip(&together) {
        let end = answer.iter().position(|x| stops.contains(x)).map_or(answer.len(), |i| i + 1);
        stopped_early += usize::from(end < 20);
        assert_eq!(c.tokens, [&prompt[..], &answer[..end]].concat());
        let fwd = m.forward(&c.tokens[..c.tokens.len() - 1], &mut m.new_cache(), &[], &layers).unwrap();
        let mut want = frspec::engine::cpu::CpuFeatures::new(m.config.hidden, &layers);
        want.append(&fwd.hidden, &fwd.layer_inputs);
        assert_eq!((&c.features.hidden, &c.features.layers), (&want.hidden, &want.layers));
    }
    assert!((2..prompts.len()).contains(&stopped_early), "{stopped_early} answers stopped early");
}
