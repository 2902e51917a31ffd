//! Chat templates (Jinja, as shipped in tokenizer_config.json or GGUF `tokenizer.chat_template`), rendered
//! with minijinja the way HF transformers' `apply_chat_template` does.

use anyhow::{anyhow, Result};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }
}

const TEMPLATE_FUEL: u64 = 10_000_000;

#[derive(Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> ChatTemplate {
        ChatTemplate { source: source.into(), bos_token: bos_token.into(), eos_token: eos_token.into() }
    }

    /// The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's reply begins.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut env = Environment::new();
        // transformers renders with trim_blocks and lstrip_blocks; templates are written for that.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // A template comes with the model, from whoever published it: one that loops for ever must end in an error.
        // Real chat templates take thousands of steps for a long conversation.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).map_err(|e| anyhow!("chat template does not parse: {e}"))?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        env.get_template("chat")
            .and_then(|t| t.render(ctx))
            .map_err(|e| anyhow!("chat template failed to render: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_default_system_prompt_and_generation_prompt() {
        let chatml = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
            {{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + \
            message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(chatml, "", "<|im_end|>");
        let out = t.render(&[Message::new("user", "Hi")], true).unwrap();
        assert_eq!(out, "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        let own = t.render(&[Message::new("system", "S"), Message::new("user", "Hi")], false).unwrap();
        assert_eq!(own, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\
             {{ m['content'] | trim }}{{ m['role'].upper() }}{% endfor %}",
            "<s>",
            "</s>",
        );
        assert_eq!(t.render(&[Message::new("user", "  x ")], false).unwrap(), "<s>xUSER");
        let err = t.render(&[Message::new("tool", "x")], false).unwrap_err();
        assert!(err.to_string().contains("no tools"), "{err}");
    }

    #[test]
    fn a_template_that_never_ends_is_an_error() {
        let t = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "", "");
        let err = t.render(&[Message::new("user", "x")], false).unwrap_err();
        assert!(err.to_string().contains("fuel"), "{err}");
    }
}
