use crate::model::{GgufFile, ModelConfig, WeightFormat};
use crate::tokenize::{ChatTemplate, Tokenizer};
use anyhow::Result;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Model key or GGUF path.
    #[arg(default_value = "smollm2-135m")]
    model: String,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let path = crate::fetch::resolve_model(&args.model, true)?;
    let file = GgufFile::open(&path)?;
    let c = ModelConfig::from_gguf(&file.content)?;
    println!("file:          {}", path.display());
    println!("architecture:  {}", c.arch.name());
    println!("layers:        {}", c.n_layers);
    println!("hidden:        {}", c.hidden);
    println!("ffn:           {}", c.ffn);
    println!("heads:         {} query / {} kv, head dim {}", c.n_heads, c.n_kv_heads, c.head_dim);
    println!("vocab:         {}", c.vocab);
    println!("context:       {}", c.context_len);
    println!("rope:          theta {}, dims {}, {:?}", c.rope_theta, c.rope_dim, c.rope_style);
    println!("rms eps:       {}", c.rms_eps);
    println!("lm head:       {}", if c.tied_head { "tied to token_embd" } else { "separate" });
    println!("qkv bias:      {}", c.qkv_bias);
    let types: Vec<String> = file.type_counts().iter().map(|(t, n)| format!("{t}×{n}")).collect();
    println!("tensor types:  {}", types.join(", "));
    println!("default weights: {}", WeightFormat::default_for(&file, &crate::model::KernelSettings::from_env()).name());
    let tok = Tokenizer::from_gguf(&file.content)?;
    let name = |id: Option<u32>| id.and_then(|i| tok.token_text(i).map(|t| format!("{i} {t:?}"))).unwrap_or("-".into());
    // The file's own pre-tokenizer name, and which split it maps to here.
    let pre =
        match (file.content.metadata.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()), tok.pre_tokenizer()) {
            (Some(name), Some(kind)) => format!("{name} ({kind:?} split)"),
            (_, None) => "none (SentencePiece)".to_string(),
            (None, Some(kind)) => format!("{kind:?} split"),
        };
    println!(
        "tokenizer:     {} tokens, pre {pre}, bos {}, eos {}, add_bos {}",
        tok.vocab_size(),
        name(tok.bos_id()),
        name(tok.eos_id()),
        tok.add_bos()
    );
    println!("stop ids:      {:?}", tok.stop_ids());
    match ChatTemplate::from_gguf(&file.content) {
        Ok(t) => println!("chat template ({:?}):\n{}", t.origin(), t.source()),
        Err(e) => println!("chat template: none ({e})"),
    }
    Ok(())
}
