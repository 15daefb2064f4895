//! `specula train data`: the batched data path writes exactly the target's own greedy output,
//! masks exactly the response, resumes without duplicates (also after a cut-off line), and
//! never takes evaluation prompts.

mod common;

use specula::engine::{generate, EngineModel, GenerateOptions, LoadedModel};
use specula::train::data::{
    self, check_no_eval_prompts, check_no_eval_prompts_against, generate_data, read_examples, DataSettings, Example,
    GenSettings, PromptSource, ResponseSource,
};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn target() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        LoadedModel::load(&common::smollm2_path(), None, &candle_core::Device::Cpu).expect("loading smollm2")
    })
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("specula-train-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Six short chats in the FastChat / ShareGPT format (a local stand-in for a downloaded set).
fn prompts_file(dir: &Path) -> PathBuf {
    let texts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain recursion to a child in two sentences.",
        "List three prime numbers.",
        "How do I make a cup of tea?",
        "Say hello in Spanish.",
    ];
    let chats: Vec<_> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": format!("t{i}"), "conversations": [
                {"from": "human", "value": t}, {"from": "gpt", "value": format!("Reference answer {i}: {t}")}]})
        })
        .collect();
    let path = dir.join("chats.json");
    std::fs::write(&path, serde_json::to_string(&chats).unwrap()).unwrap();
    path
}

fn settings(prompts: &Path, out: &Path, limit: usize) -> DataSettings {
    DataSettings {
        sources: vec![PromptSource::File { key: "fastchat-dummy".into(), path: prompts.to_path_buf() }],
        skip: 0,
        limit: Some(limit),
        gen: GenSettings {
            max_new_tokens: 8,
            temperature: 0.0,
            seed: 0,
            chat_template_kwargs: Default::default(),
            responses: Default::default(),
        },
        out: out.to_path_buf(),
        batch: 4,
        shard_size: 4,
        kv_tokens: 4096,
        max_prompt_tokens: None,
        features: None,
    }
}

fn examples(dir: &Path) -> Vec<Example> {
    read_examples(dir, false).unwrap().examples
}

fn shard_text(dir: &Path) -> String {
    (0..)
        .map(|i| dir.join(data::shard_name(i)))
        .take_while(|p| p.exists())
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect()
}

#[test]
fn batched_data_is_the_targets_own_greedy_output_with_the_response_masked() {
    let work = tempdir("equal");
    let prompts = prompts_file(&work);
    let out = work.join("out");
    let mut s = settings(&prompts, &out, 6);
    s.gen.max_new_tokens = 16;
    let summary = generate_data(target(), &s, &mut |_| {}).unwrap();
    assert_eq!((summary.prompts, summary.written, summary.already), (6, 6, 0));
    assert!(summary.run.tokens_per_sec > 0.0);
    let exs = examples(&out);
    assert_eq!(exs.len(), 6);
    // Shards of 4: two files.
    assert!(out.join("shard-00001.jsonl").exists());
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["examples"], 6);
    assert_eq!(meta["target"]["vocab_size"], target().tokenizer.vocab_size());

    let loaded = target();
    let pool = loaded.model.new_kv_pool(4096);
    let opts = GenerateOptions { stop_ids: loaded.stop_ids(), ..GenerateOptions::default() };
    let source = datasets_prompts(&prompts);
    for ex in &exs {
        let p = source.iter().find(|p| p.id == ex.id).expect("example of a known prompt");
        assert_eq!(ex.set, "fastchat-dummy");
        assert_eq!(ex.prompt, p.text);
        let ids = data::encode(loaded, p, &Default::default()).unwrap();
        assert_eq!(&ex.tokens[..ex.prompt_tokens], &ids[..], "{}: prompt tokens", ex.id);
        let params = data::example_params(
            &GenSettings {
                max_new_tokens: 16,
                temperature: 0.0,
                seed: 0,
                chat_template_kwargs: Default::default(),
                responses: Default::default(),
            },
            &ex.set,
            &ex.id,
        );
        let alone = generate(
            EngineModel { model: &loaded.model, tokenizer: None },
            &pool,
            &ids,
            params,
            None,
            &opts,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(ex.response(), &alone.tokens[..], "{}: batched output differs from generate alone", ex.id);
        assert!(!alone.tokens.is_empty());
        // The loss mask: 0 over the prompt, 1 over exactly the response.
        assert_eq!(ex.loss_mask.len(), ex.tokens.len());
        assert!(ex.loss_mask[..ex.prompt_tokens].iter().all(|&m| m == 0), "{}", ex.id);
        assert!(ex.loss_mask[ex.prompt_tokens..].iter().all(|&m| m == 1), "{}", ex.id);
        assert_eq!(ex.loss_mask.iter().filter(|&&m| m == 1).count(), alone.tokens.len());
        let finish = if alone.tokens.len() == 16 { "length" } else { "stop" };
        assert_eq!(ex.finish, finish, "{}", ex.id);
    }
    // Made only of training prompts: the check passes on it.
    let check = check_no_eval_prompts(&out).unwrap();
    assert_eq!(check.examples, 6);
    let _ = std::fs::remove_dir_all(&work);
}

fn datasets_prompts(path: &Path) -> Vec<specula::datasets::Prompt> {
    specula::datasets::load_from_path("fastchat-dummy", path, None).unwrap()
}

#[test]
fn resume_appends_the_rest_without_duplicates_and_recovers_a_cut_off_line() {
    let work = tempdir("resume");
    let prompts = prompts_file(&work);
    let out = work.join("out");
    let first = generate_data(target(), &settings(&prompts, &out, 3), &mut |_| {}).unwrap();
    assert_eq!(first.written, 3);
    let after_three = shard_text(&out);
    let three = examples(&out);

    let second = generate_data(target(), &settings(&prompts, &out, 6), &mut |_| {}).unwrap();
    assert_eq!((second.already, second.written), (3, 3));
    let all = examples(&out);
    assert_eq!(all.len(), 6);
    assert_eq!(&all[..3], &three[..], "the first three examples changed");
    assert!(shard_text(&out).starts_with(&after_three));
    let mut keys: Vec<_> = all.iter().map(|e| (e.set.clone(), e.id.clone())).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 6, "duplicate examples");

    // Nothing left: a rerun writes nothing.
    let third = generate_data(target(), &settings(&prompts, &out, 6), &mut |_| {}).unwrap();
    assert_eq!((third.already, third.written), (6, 0));
    assert_eq!(examples(&out), all);

    // A run killed mid-line: the last shard (shard 1, examples 5 and 6) ends in half a line.
    let last = out.join(data::shard_name(1));
    let text = std::fs::read_to_string(&last).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    let cut = format!("{}\n{}", lines[0], &lines[1][..lines[1].len() / 2]);
    std::fs::write(&last, &cut).unwrap();
    assert_eq!(examples(&out).len(), 5);
    let fourth = generate_data(target(), &settings(&prompts, &out, 6), &mut |_| {}).unwrap();
    assert!(fourth.dropped_partial_line);
    assert_eq!((fourth.already, fourth.written), (5, 1));
    let recovered = examples(&out);
    assert_eq!(recovered.len(), 6);
    assert_eq!(&recovered[..5], &all[..5]);
    assert_eq!(recovered[5], all[5], "the regenerated example differs");
    assert!(std::fs::read_to_string(&last).unwrap().ends_with('\n'));
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn refuses_eval_sets_other_targets_and_empty_sets() {
    let work = tempdir("refuse");
    let prompts = prompts_file(&work);
    let out = work.join("out");
    for key in data::EVAL_SETS {
        let mut s = settings(&prompts, &out, 2);
        s.sources = vec![PromptSource::Set(key.to_string())];
        let err = format!("{:#}", generate_data(target(), &s, &mut |_| {}).unwrap_err());
        assert!(err.contains("evaluation set"), "{key}: {err}");
        // Even in a file of that set's format.
        s.sources = vec![PromptSource::File { key: key.to_string(), path: prompts.clone() }];
        let err = format!("{:#}", generate_data(target(), &s, &mut |_| {}).unwrap_err());
        assert!(err.contains("evaluation set"), "{key}: {err}");
    }
    assert!(!out.exists(), "a refused run must not create the output");

    let empty = work.join("empty.json");
    std::fs::write(&empty, "[]").unwrap();
    let mut s = settings(&prompts, &out, 2);
    s.sources = vec![PromptSource::File { key: "fastchat-dummy".into(), path: empty }];
    let err = format!("{:#}", generate_data(target(), &s, &mut |_| {}).unwrap_err());
    assert!(err.contains("no prompts"), "{err}");

    let mut s = settings(&prompts, &out, 2);
    s.sources = vec![PromptSource::Set("no-such-set".into())];
    let err = format!("{:#}", generate_data(target(), &s, &mut |_| {}).unwrap_err());
    assert!(err.contains("unknown prompt set"), "{err}");

    // A directory made for another target is refused, and so are other settings.
    generate_data(target(), &settings(&prompts, &out, 1), &mut |_| {}).unwrap();
    let meta_path = out.join("meta.json");
    let original = std::fs::read_to_string(&meta_path).unwrap();
    let mut meta: serde_json::Value = serde_json::from_str(&original).unwrap();
    meta["target"]["file_name"] = "qwen2.5-coder-0.5b.gguf".into();
    meta["target"]["vocab_size"] = 151_936.into();
    std::fs::write(&meta_path, meta.to_string()).unwrap();
    let err = format!("{:#}", generate_data(target(), &settings(&prompts, &out, 2), &mut |_| {}).unwrap_err());
    assert!(err.contains("another target"), "{err}");
    std::fs::write(&meta_path, &original).unwrap();
    let mut other = settings(&prompts, &out, 2);
    other.gen.max_new_tokens = 9;
    let err = format!("{:#}", generate_data(target(), &other, &mut |_| {}).unwrap_err());
    assert!(err.contains("other settings"), "{err}");
    assert_eq!(examples(&out).len(), 1, "refused runs must not write");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn the_command_line_refuses_eval_sets_and_missing_models_clearly() {
    let work = tempdir("cli");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_specula")).args(args).output().unwrap();
        (o.status.code(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let out = work.join("out");
    let out = out.to_str().unwrap();
    let (code, err) =
        run(&["train", "data", "--target", "smollm2-135m", "--prompts", "fastchat-dummy,gsm8k-100", "--out", out]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("`gsm8k-100` is an evaluation set") && !err.contains("panicked"), "{err}");
    let (code, err) =
        run(&["train", "data", "--target", "/no/such/model.gguf", "--prompts", "fastchat-dummy", "--out", out]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.starts_with("error:") && !err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn eval_prompt_check_catches_eval_sets_ids_and_texts() {
    let work = tempdir("evalcheck");
    let write = |exs: &[Example]| {
        let lines: String = exs.iter().map(|e| serde_json::to_string(e).unwrap() + "\n").collect();
        std::fs::write(work.join(data::shard_name(0)), lines).unwrap();
    };
    let ex = |set: &str, id: &str, prompt: &str| Example {
        set: set.into(),
        id: id.into(),
        prompt: prompt.into(),
        prompt_tokens: 1,
        tokens: vec![1, 2],
        loss_mask: vec![0, 1],
        finish: "stop".into(),
    };
    // An example labelled with an evaluation set fails the real check (no files needed).
    write(&[ex("fastchat-dummy", "fastchat-dummy/a", "hi"), ex("gsm8k-100", "gsm8k-100/0000", "Q")]);
    let err = check_no_eval_prompts(&work).unwrap_err().to_string();
    assert!(err.contains("gsm8k-100/0000"), "{err}");

    // Evaluation prompts given as fixtures: their ids and texts are caught under any set name.
    let eval = vec![(
        "humaneval".to_string(),
        vec![specula::datasets::Prompt {
            id: "HumanEval/0".into(),
            text: "def has_close_elements(numbers, threshold):\n".into(),
            kind: specula::datasets::PromptKind::Completion,
            reference: None,
            response: None,
        }],
    )];
    write(&[ex("sharegpt", "sharegpt/x", "def has_close_elements(numbers,  threshold):")]);
    let err = check_no_eval_prompts_against(&work, &eval).unwrap_err().to_string();
    assert!(err.contains("HumanEval/0"), "{err}");
    write(&[ex("sharegpt", "HumanEval/0", "something else")]);
    assert!(check_no_eval_prompts_against(&work, &eval).is_err());
    write(&[ex("sharegpt", "sharegpt/y", "something else")]);
    assert_eq!(check_no_eval_prompts_against(&work, &eval).unwrap().examples, 1);

    // Against the real evaluation files on this machine (whichever are fetched; humaneval and
    // gsm8k-100 are fetched by other tests): a copied prompt is caught.
    for (key, file) in [("humaneval", "humaneval"), ("gsm8k-100", "gsm8k-100")] {
        let path = specula::fetch::find_asset(file).unwrap().path();
        if !path.is_file() {
            eprintln!("{key} is not fetched: its real-file check is skipped");
            continue;
        }
        let first = specula::datasets::load_from_path(key, &path, Some(1)).unwrap().remove(0);
        write(&[ex("sharegpt", "sharegpt/z", &first.text)]);
        let err = check_no_eval_prompts(&work).unwrap_err().to_string();
        assert!(err.contains(&first.id), "{key}: {err}");
    }
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn dataset_responses_are_the_sets_own_answers_cut_at_the_limit() {
    let work = tempdir("dataset-responses");
    let prompts = prompts_file(&work);
    let out = work.join("out");
    let mut s = settings(&prompts, &out, 6);
    s.gen.responses = ResponseSource::Dataset;
    s.gen.max_new_tokens = 6;
    let summary = generate_data(target(), &s, &mut |_| {}).unwrap();
    assert_eq!((summary.written, summary.skipped.len()), (6, 0));
    let loaded = target();
    let source = datasets_prompts(&prompts);
    let mut cut = 0;
    for ex in examples(&out) {
        let p = source.iter().find(|p| p.id == ex.id).expect("example of a known prompt");
        let ids = data::encode(loaded, p, &Default::default()).unwrap();
        assert_eq!(&ex.tokens[..ex.prompt_tokens], &ids[..], "{}: prompt tokens", ex.id);
        let answer = loaded.tokenizer.encode(p.response.as_deref().unwrap(), false).unwrap();
        assert!(answer.len() > 1, "{}", ex.id);
        assert_eq!(ex.response(), &answer[..answer.len().min(6)], "{}: the set's answer, cut at 6 tokens", ex.id);
        assert_eq!(ex.finish, if answer.len() > 6 { "length" } else { "stop" });
        cut += usize::from(answer.len() > 6);
        assert!(ex.loss_mask[ex.prompt_tokens..].iter().all(|&m| m == 1));
        assert!(ex.loss_mask[..ex.prompt_tokens].iter().all(|&m| m == 0));
    }
    assert!(cut > 0, "some answers run past the limit");
    let meta: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["settings"]["responses"], "dataset");
    // The same directory resumed with the target's answers is refused: not one kind of data.
    let mut other = settings(&prompts, &out, 6);
    other.gen.max_new_tokens = 6;
    let err = generate_data(target(), &other, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("other settings"), "{err}");

    // A chat without a model turn has no answer of its own: skipped, not an empty example.
    let lone = work.join("lone.json");
    std::fs::write(&lone, r#"[{"id": "q", "conversations": [{"from": "human", "value": "Hi there"}]}]"#).unwrap();
    let mut s = settings(&lone, &work.join("lone"), 6);
    s.gen.responses = ResponseSource::Dataset;
    let summary = generate_data(target(), &s, &mut |_| {}).unwrap();
    assert_eq!((summary.written, summary.skipped.clone()), (0, vec!["fastchat-dummy/fastchat-dummy/q".to_string()]));

    // A prompt that leaves 3 tokens of context: its answer is cut there, as generation would
    // have stopped, and says so.
    let ctx = target().model.config.context_len;
    let long = work.join("long.json");
    let write_chat = |words: usize| {
        let chat = serde_json::json!([{"id": "long", "conversations": [
            {"from": "human", "value": "a ".repeat(words)},
            {"from": "gpt", "value": "one two three four five six seven eight nine ten"}]}]);
        std::fs::write(&long, chat.to_string()).unwrap();
        data::encode(target(), &datasets_prompts(&long)[0], &Default::default()).unwrap().len()
    };
    let mut words = ctx;
    for _ in 0..4 {
        let len = write_chat(words);
        words = (words + ctx - 3).saturating_sub(len);
    }
    assert_eq!(write_chat(words), ctx - 3, "a prompt of exactly ctx − 3 tokens");
    let mut s = settings(&long, &work.join("long"), 1);
    s.gen.responses = ResponseSource::Dataset;
    s.gen.max_new_tokens = 6;
    s.kv_tokens = 2 * ctx;
    let summary = generate_data(target(), &s, &mut |_| {}).unwrap();
    assert_eq!(summary.written, 1, "skipped: {:?}", summary.skipped);
    let ex = examples(&work.join("long")).remove(0);
    let answer = target().tokenizer.encode("one two three four five six seven eight nine ten", false).unwrap();
    assert_eq!((ex.response(), ex.finish.as_str()), (&answer[..3], "context_full"));
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn sampled_data_does_not_depend_on_the_batch() {
    let work = tempdir("sampled");
    let prompts = prompts_file(&work);
    let run = |batch: usize, name: &str| {
        let mut s = settings(&prompts, &work.join(name), 6);
        s.gen.temperature = 0.9;
        s.gen.seed = 7;
        s.batch = batch;
        generate_data(target(), &s, &mut |_| {}).unwrap();
        let mut exs = examples(&work.join(name));
        exs.sort_by(|a, b| a.id.cmp(&b.id));
        exs
    };
    let batched = run(4, "b4");
    let alone = run(1, "b1");
    assert_eq!(batched, alone, "each example samples with its own seed, whatever runs beside it");
    let _ = std::fs::remove_dir_all(&work);
}

#[test]
fn skip_leaves_out_the_first_prompts_of_a_set() {
    let work = tempdir("skip");
    let prompts = prompts_file(&work);
    let mut s = settings(&prompts, &work.join("out"), 3);
    s.skip = 2;
    s.gen.responses = ResponseSource::Dataset;
    let summary = generate_data(target(), &s, &mut |_| {}).unwrap();
    assert_eq!(summary.written, 3);
    let mut got: Vec<String> = examples(&work.join("out")).into_iter().map(|e| e.id).collect();
    got.sort();
    let mut want: Vec<String> = datasets_prompts(&prompts)[2..5].iter().map(|p| p.id.clone()).collect();
    want.sort();
    assert_eq!(got, want, "prompts 3 to 5 of the set");
    s.skip = 6;
    let err = generate_data(target(), &s, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("none left after skipping 6"), "{err}");
    let _ = std::fs::remove_dir_all(&work);
}

/// The data directories kept in the repository (`data/`) hold no prompt of any evaluation set
/// (gsm8k-100, humaneval and its edit variant, humaneval-rust, mt-bench, math500), by set, id
/// or text.
#[test]
fn kept_data_directories_hold_no_evaluation_prompt() {
    for key in ["gsm8k-100", "humaneval", "mt-bench", "math500", "humaneval-rust"] {
        specula::fetch::fetch_once(key, false).unwrap_or_else(|e| panic!("fetching {key}: {e:#}"));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("data");
    let mut checked = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.join("meta.json").is_file() {
            continue;
        }
        let check = check_no_eval_prompts(&dir).unwrap_or_else(|e| panic!("{e:#}"));
        assert!(check.examples > 0 && check.sets_unavailable.is_empty(), "{}: {check:?}", dir.display());
        checked += 1;
    }
    assert!(checked >= 3, "{checked} data directories under {}", root.display());
}

/// The word problems a target wrote for training (`data/prompts/word-problems.jsonl`) share no run
/// of 8 words (case and punctuation aside) with any gsm8k-100 question: the rule their script
/// kept them by, checked here against the fetched evaluation file.
#[test]
fn word_problems_share_no_run_of_8_words_with_gsm8k() {
    specula::fetch::fetch_once("gsm8k-100", false).unwrap_or_else(|e| panic!("fetching gsm8k-100: {e:#}"));
    let eval: HashSet<_> =
        specula::datasets::load("gsm8k-100", None).unwrap().iter().flat_map(|p| runs_of_8(&p.text)).collect();
    assert!(eval.len() > 1000, "{} runs", eval.len());
    let problems = specula::datasets::load("word-problems", None).unwrap();
    assert!(problems.len() >= 500, "{}", problems.len());
    for p in &problems {
        let shared: Vec<_> = runs_of_8(&p.text).intersection(&eval).cloned().collect();
        assert!(shared.is_empty(), "{} shares {:?} with gsm8k-100", p.id, shared);
    }
}

/// The function stubs the target wrote share no run of 8 words with a HumanEval prompt and
/// define no function a HumanEval prompt defines.
#[test]
fn function_stubs_share_no_run_of_8_words_or_function_name_with_humaneval() {
    fn defined(text: &str) -> impl Iterator<Item = &str> {
        text.split("def ").skip(1).filter_map(|rest| rest.split('(').next())
    }
    specula::fetch::fetch_once("humaneval", false).unwrap_or_else(|e| panic!("fetching humaneval: {e:#}"));
    let humaneval = specula::datasets::load("humaneval", None).unwrap();
    let eval: HashSet<_> = humaneval.iter().flat_map(|p| runs_of_8(&p.text)).collect();
    let names: HashSet<&str> = humaneval.iter().flat_map(|p| defined(&p.text)).collect();
    assert!(eval.len() > 1000 && names.len() >= 150, "{} runs, {} names", eval.len(), names.len());
    let stubs = specula::datasets::load("function-stubs", None).unwrap();
    assert!(stubs.len() >= 250, "{}", stubs.len());
    for p in &stubs {
        let shared: Vec<_> = runs_of_8(&p.text).intersection(&eval).cloned().collect();
        assert!(shared.is_empty(), "{} shares {:?} with humaneval", p.id, shared);
        assert!(defined(&p.text).all(|name| !names.contains(name)), "{} defines a HumanEval function", p.id);
    }
}

/// The runs of 8 words of a text, lower-cased, punctuation ignored.
fn runs_of_8(text: &str) -> HashSet<Vec<String>> {
    let words: Vec<String> = text
        .to_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect();
    words.windows(8).map(<[String]>::to_vec).collect()
}

/// `train data --features`: every example's features come from the same pass that generated
/// it, equal to what a separate prefill of the example gives (the trainers' own features), and
/// the examples are those of a run without features.
#[test]
fn features_written_while_generating_equal_a_prefill_of_each_example() {
    use specula::train::features::{target_features, FeatureCache, FeatureKey};
    let work = tempdir("features");
    let prompts = prompts_file(&work);
    let (plain, with) = (work.join("plain"), work.join("with"));
    let mut s = settings(&prompts, &plain, 6);
    s.gen.max_new_tokens = 12;
    generate_data(target(), &s, &mut |_| {}).unwrap();
    let layers = vec![1, 8, 29];
    let key = FeatureKey {
        target: "smollm2".into(),
        target_sha256: String::new(),
        layer_ids: layers.clone(),
        hidden: target().model.config.hidden,
        max_tokens: 1024,
    };
    let parent = work.join("features");
    s.out = with.clone();
    s.features = Some(data::DataFeatures { key: key.clone(), dir: Some(parent.clone()) });
    generate_data(target(), &s, &mut |_| {}).unwrap();
    let (a, b) = (examples(&plain), examples(&with));
    assert_eq!(a, b, "the examples do not depend on writing features");
    assert!(a.iter().any(|e| e.finish == "length") && a.iter().any(|e| e.finish == "stop"), "both endings covered");
    // Where a trainer on this directory looks for them.
    let cache_dir = specula::train::features::default_dir(&key, &with, Some(&parent)).unwrap();
    let mut cache = FeatureCache::open(&cache_dir, key).unwrap();
    assert_eq!(cache.len(), 6);
    let mut worst = 0f32;
    for e in &b {
        let got = cache.read(&format!("{}/{}", e.set, e.id), &candle_core::Device::Cpu).unwrap();
        let want = target_features(&target().model, &layers, &e.tokens, specula::kv::KvDtype::F16).unwrap();
        // Every row but the last token's (the engine does not show a finished request's last
        // step; no trainer reads it).
        assert_eq!(got.dim(0).unwrap(), e.tokens.len() - 1, "{}", e.id);
        let want = want.narrow(0, 0, e.tokens.len() - 1).unwrap();
        // The cache holds f16: compare against the prefill's features rounded the same way.
        let want = want.to_dtype(candle_core::DType::F16).unwrap().to_dtype(candle_core::DType::F32).unwrap();
        let d = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        worst = worst.max(d);
    }
    eprintln!("largest difference from a prefill: {worst}");
    assert_eq!(worst, 0.0, "features from generation differ from a prefill by {worst}");
    let _ = std::fs::remove_dir_all(&work);
}
