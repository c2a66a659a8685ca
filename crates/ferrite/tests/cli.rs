//! Start-up flags of the real binary: devices and load formats it cannot serve fail at once
//! with a message that says what to do.

use std::process::Command;

fn ferrite(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .output()
        .expect("run ferrite");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
#[cfg(not(feature = "cuda"))]
fn cuda_device_without_the_feature_says_how_to_build_it() {
    let (ok, err) = ferrite(&[
        "generate",
        "missing.gguf",
        "--prompt",
        "hi",
        "--device",
        "cuda",
    ]);
    assert!(!ok);
    assert!(err.contains("built without CUDA support"), "{err}");
    assert!(err.contains("--features cuda"), "{err}");
}

#[test]
fn unknown_device_is_a_usage_error() {
    let (ok, err) = ferrite(&["generate", "m.gguf", "--prompt", "hi", "--device", "tpu"]);
    assert!(!ok);
    assert!(
        err.contains("unknown device `tpu` (cpu, cuda[:N], metal[:N], vulkan[:N], wgpu[:N])"),
        "{err}"
    );
}

/// A GPU through wgpu that is not there is named, with what to do, before any weight is read:
/// Metal off a Mac, an adapter past the last (CI has one Vulkan adapter: lavapipe).
#[test]
#[cfg(target_os = "linux")]
fn a_missing_wgpu_adapter_says_what_is_there() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let model = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .output()
        .expect("fetch-model.sh");
    let model = String::from_utf8(model.stdout).unwrap();
    let run = |device: &str| {
        ferrite(&[
            "generate",
            model.trim(),
            "--prompt",
            "hi",
            "--device",
            device,
        ])
    };
    let (ok, err) = run("metal");
    assert!(!ok);
    assert!(
        err.contains("--device metal: no Metal adapter found"),
        "{err}"
    );
    assert!(err.contains("Metal needs macOS"), "{err}");
    let (ok, err) = run("vulkan:7");
    assert!(!ok);
    assert!(err.contains("--device vulkan:7: there are "), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `--load-format dummy` draws random weights from the config alone, on the CPU too: a folder
/// holding nothing but a Gemma 3 `config.json` serves (and fails without the flag).
#[test]
fn dummy_weights_need_only_the_config() {
    let src =
        env!("CARGO_MANIFEST_DIR").to_string() + "/../../tests/oracle/tiny/gemma3/config.json";
    let dir = std::env::temp_dir().join(format!("ferrite-dummy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src, dir.join("config.json")).unwrap();
    let dir = dir.to_str().unwrap();
    let args = |dummy: bool| {
        // Random weights may draw the end of sequence: ignored, so the run takes its 3 tokens.
        let mut a = vec![
            "generate",
            dir,
            "--prompt",
            "<5> <17>",
            "--max-tokens",
            "3",
            "--ignore-eos",
        ];
        a.extend(["--kv-cache-memory", "10000000"]);
        if dummy {
            a.extend(["--load-format", "dummy"]);
        }
        a
    };
    let (ok, err) = ferrite(&args(true));
    assert!(ok, "{err}");
    assert!(err.contains("finish_reason=length tokens=3"), "{err}");
    let (ok, err) = ferrite(&args(false));
    assert!(!ok);
    assert!(err.contains("no *.safetensors files"), "{err}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn hugging_face_folders_run_on_the_cpu() {
    // A tiny random-weight Qwen3 (tests/oracle/make_tiny.py): no tokenizer.json, so the
    // placeholder vocabulary reads `<id>` words.
    let root = env!("CARGO_MANIFEST_DIR").to_string() + "/../../tests/oracle/tiny/qwen3";
    let (ok, err) = ferrite(&[
        "generate",
        &root,
        "--prompt",
        "<5> <17> <33>",
        "--max-tokens",
        "4",
        "--kv-cache-memory",
        "10000000",
    ]);
    assert!(ok, "{err}");
    assert!(err.contains("finish_reason=length tokens=4"), "{err}");
    let dir = std::env::temp_dir().join(format!("ferrite-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ok, err) = ferrite(&["generate", dir.to_str().unwrap(), "--prompt", "hi"]);
    assert!(!ok);
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn bench_depth_needs_the_prefix_cache() {
    let (ok, err) = ferrite(&[
        "bench",
        "offline",
        "m.gguf",
        "--depth",
        "0,64",
        "--no-enable-prefix-caching",
    ]);
    assert!(!ok);
    assert!(
        err.contains("--depth needs the prefix cache to hold the context"),
        "{err}"
    );
}

/// `bench offline --depth` on the test model: a row per test and depth, llama-bench's labels.
#[test]
fn bench_offline_reports_each_depth() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let fetched = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .output()
        .expect("fetch-model.sh");
    assert!(fetched.status.success());
    let model = String::from_utf8(fetched.stdout).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["bench", "offline", model.trim(), "--prompt-tokens", "16"])
        .args(["--gen-tokens", "4", "--batch", "1,2", "--depth", "0,40"])
        .args(["--repeats", "1", "--log-level", "warn"])
        .output()
        .expect("run ferrite");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<&str> = table
        .lines()
        .filter_map(|l| l.strip_prefix("| ")?.split(" |").next())
        .collect();
    assert_eq!(
        rows,
        [
            "test",
            "---",
            "pp16",
            "tg4 @ batch 1",
            "tg4 @ batch 2",
            "pp16 @ d40",
            "tg4 @ batch 1 @ d40",
            "tg4 @ batch 2 @ d40"
        ],
        "{table}"
    );
}

/// `org/name` and `org/name:QUANT` from a Hugging Face cache tree built on disk (offline).
#[test]
fn hugging_face_ids_resolve_through_the_local_cache() {
    let tiny = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/oracle/tiny");
    let cache = std::env::temp_dir().join(format!("ferrite-hf-cache-{}", std::process::id()));
    let repo = cache.join("models--test--tiny-qwen3");
    let snap = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd\n").unwrap();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(tiny.join("qwen3").join(f), snap.join(f)).unwrap();
    }
    // A GGUF repository as the cache keeps it (files are links to blobs): the real test model
    // and a second quantization.
    let out = Command::new("bash")
        .arg(tiny.join("../../../scripts/fetch-model.sh"))
        .output()
        .unwrap();
    let smollm2 = std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    let gguf_repo = cache.join("models--test--smollm2-gguf");
    let gsnap = gguf_repo.join("snapshots/4567ef");
    std::fs::create_dir_all(&gsnap).unwrap();
    std::fs::create_dir_all(gguf_repo.join("refs")).unwrap();
    std::fs::write(gguf_repo.join("refs/main"), "4567ef").unwrap();
    let link = |from: &std::path::Path, to: &str| {
        let _ = std::fs::remove_file(gsnap.join(to));
        std::os::unix::fs::symlink(from, gsnap.join(to)).unwrap();
    };
    link(&smollm2, "smollm2-Q4_1.gguf");
    link(&tiny.join("qwen3.gguf"), "smollm2-Q8_0.gguf");
    let run_in = |hf_cache: &std::path::Path, model: &str, extra: &[&str]| {
        let mut args = vec![
            "generate",
            model,
            "--prompt",
            "<5> <17> <33>",
            "--max-tokens",
            "2",
            "--kv-cache-memory",
            "10000000",
            "--max-model-len",
            "256",
        ];
        args.extend_from_slice(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
            .args(&args)
            .env("HF_HUB_CACHE", hf_cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let run = |model: &str, extra: &[&str]| run_in(&cache, model, extra);
    // The folder (config.json), then the GGUF picked by its quantization's name.
    let (ok, err) = run("test/tiny-qwen3", &[]);
    assert!(ok && err.contains("finish_reason=length tokens=2"), "{err}");
    let (ok, err) = run("test/smollm2-gguf:q4_1", &[]);
    assert!(ok && err.contains("smollm2-Q4_1.gguf"), "{err}");
    let (ok, err) = run("test/smollm2-gguf", &[]);
    assert!(!ok && err.contains("several GGUF files"), "{err}");
    let (ok, err) = run("test/smollm2-gguf:q4_k_m", &[]);
    assert!(
        !ok && err.contains("no GGUF file matching `q4_k_m`"),
        "{err}"
    );
    let (ok, err) = run("test/tiny-qwen3", &["--revision", "v2"]);
    assert!(!ok && err.contains("revision v2"), "{err}");
    let (ok, err) = run("HuggingFaceTB/SmolLM2-135M-Instruct", &[]);
    assert!(!ok, "{err}");
    assert!(
        err.contains("not in the Hugging Face cache")
            && err.contains("HF_HUB_OFFLINE is set")
            && err.contains("huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct"),
        "{err}"
    );
    // vLLM's --download-dir names the cache instead of the environment.
    let elsewhere = std::env::temp_dir().join("ferrite-no-such-cache");
    let (ok, err) = run_in(
        &elsewhere,
        "test/tiny-qwen3",
        &["--download-dir", cache.to_str().unwrap()],
    );
    assert!(ok && err.contains("finish_reason=length tokens=2"), "{err}");
    let (ok, err) = run("test/absent", &["--download-dir", "/nonexistent-cache"]);
    assert!(
        !ok && err.contains("--cache-dir /nonexistent-cache"),
        "{err}"
    );
}

/// A Hugging Face hub stand-in on a local port: the repository listing and ranged file
/// reads hf-hub asks for, 401 for `test/gated`, 404 for anything else. Answers until the
/// test ends; counts the files it served.
fn fake_hub(
    folder: std::path::PathBuf,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let path = line.split(' ').nth(1).unwrap_or("").to_string();
            let mut range = None;
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                    break;
                }
                if let Some(r) = h.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    let (a, b) = r.trim().split_once('-').unwrap();
                    range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                }
            }
            let commit = "c0ffee0123456789";
            let mut out = stream;
            let reply =
                |out: &mut std::net::TcpStream, status: &str, headers: String, body: &[u8]| {
                    let head = format!(
                    "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n",
                    body.len()
                );
                    let _ = out.write_all(head.as_bytes());
                    let _ = out.write_all(body);
                };
            if path == "/api/models/test/tiny-qwen3/revision/main" {
                let mut files: Vec<String> = std::fs::read_dir(&folder)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect();
                files.extend(["README.md".into(), "onnx/model.onnx".into()]);
                let siblings: Vec<String> = files
                    .iter()
                    .map(|f| format!("{{\"rfilename\":\"{f}\"}}"))
                    .collect();
                let body = format!(
                    "{{\"sha\":\"{commit}\",\"siblings\":[{}]}}",
                    siblings.join(",")
                );
                reply(
                    &mut out,
                    "200 OK",
                    "content-type: application/json\r\n".into(),
                    body.as_bytes(),
                );
            } else if path.starts_with("/api/models/test/gated/") {
                reply(
                    &mut out,
                    "401 Unauthorized",
                    String::new(),
                    b"{\"error\":\"gated\"}",
                );
            } else if let Some(file) = path.strip_prefix("/test/tiny-qwen3/resolve/main/") {
                let data = std::fs::read(folder.join(file)).unwrap();
                let (a, b) = range.unwrap_or((0, None));
                let b = b.unwrap_or(data.len() - 1).min(data.len() - 1);
                if a == 0 && b > 0 {
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                let headers = format!(
                    "x-repo-commit: {commit}\r\netag: \"{file}-{}\"\r\ncontent-range: bytes {a}-{b}/{}\r\n",
                    data.len(),
                    data.len()
                );
                reply(&mut out, "206 Partial Content", headers, &data[a..=b]);
            } else {
                reply(&mut out, "404 Not Found", String::new(), b"{}");
            }
        }
    });
    (url, served)
}

/// Ids missing from the cache are downloaded from `HF_ENDPOINT` (only the files a folder
/// checkpoint needs), then served from the cache, offline too; a gated repository, a
/// missing one and an unreachable hub each say what to do.
#[test]
fn hugging_face_ids_download_into_the_cache() {
    let tiny =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/oracle/tiny/qwen3");
    let (hub, served) = fake_hub(tiny);
    let cache = std::env::temp_dir().join(format!("ferrite-hf-download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let run = |model: &str, endpoint: &str, offline: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrite"));
        cmd.args([
            "generate",
            model,
            "--prompt",
            "<5> <17> <33>",
            "--max-tokens",
            "2",
            "--kv-cache-memory",
            "10000000",
            "--max-model-len",
            "256",
        ])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_ENDPOINT", endpoint)
        .env_remove("HF_HUB_OFFLINE");
        if offline {
            cmd.env("HF_HUB_OFFLINE", "1");
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = run("test/tiny-qwen3", &hub, false);
    assert!(ok && err.contains("finish_reason=length tokens=2"), "{err}");
    assert!(
        err.contains("downloaded model.safetensors") && err.contains("downloaded config.json"),
        "{err}"
    );
    assert!(
        !err.contains("README.md,") && !err.contains("onnx"),
        "only the checkpoint's files: {err}"
    );
    let snapshot = cache.join("models--test--tiny-qwen3/snapshots/c0ffee0123456789");
    assert!(snapshot.join("model.safetensors").exists());
    assert_eq!(
        std::fs::read_to_string(cache.join("models--test--tiny-qwen3/refs/main"))
            .unwrap()
            .trim(),
        "c0ffee0123456789"
    );
    let fetched = served.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        fetched, 3,
        "config.json, generation_config.json, model.safetensors"
    );
    // Cached: nothing fetched again, online or offline (an unreachable hub is not asked).
    let (ok, err) = run("test/tiny-qwen3", &hub, false);
    assert!(ok && !err.contains("downloading"), "{err}");
    let (ok, err) = run("test/tiny-qwen3", "http://127.0.0.1:1", true);
    assert!(ok && err.contains("finish_reason=length tokens=2"), "{err}");
    assert_eq!(served.load(std::sync::atomic::Ordering::SeqCst), fetched);
    let (ok, err) = run("test/gated", &hub, false);
    assert!(
        !ok && err.contains("gated or private") && err.contains("HF_TOKEN"),
        "{err}"
    );
    let (ok, err) = run("test/absent", &hub, false);
    assert!(!ok && err.contains("was not found at"), "{err}");
    let (ok, err) = run("test/absent", "http://127.0.0.1:1", false);
    assert!(
        !ok && err.contains("cannot reach http://127.0.0.1:1") && err.contains("HF_HUB_OFFLINE=1"),
        "{err}"
    );
    let (ok, err) = run("test/absent", &hub, true);
    assert!(!ok && err.contains("HF_HUB_OFFLINE is set"), "{err}");
    let _ = std::fs::remove_dir_all(&cache);
}

/// The start-up line's pool size, weights and concurrency: `(blocks, "weights 0.12 GiB",
/// "1.00x")`.
fn plan_figures(line: &str) -> (usize, String, String) {
    let at = line.find("KV cache: ").expect("a plan line") + "KV cache: ".len();
    let blocks = line[at..].split(' ').next().unwrap().parse().unwrap();
    let weights = line
        .split(", ")
        .find(|p| p.starts_with("weights "))
        .unwrap();
    let conc = line
        .split("max_model_len ")
        .nth(1)
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap();
    (
        blocks,
        weights.to_string(),
        conc.trim_end_matches(';').to_string(),
    )
}

/// `ferrite ARGS` for a command that prints JSON (`plan --json`): its output, parsed.
fn json_of(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn model_file(name: &str) -> String {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .arg(name)
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// On a GPU through wgpu (lavapipe here), `ferrite plan` opens the adapter `--device` names,
/// states it (API, driver, binding limit) and plans the weights as the wgpu backend keeps
/// them: the line start-up states.
#[test]
#[cfg(feature = "wgpu")]
fn plan_names_the_wgpu_adapter() {
    let smollm2 = model_file("smollm2");
    let flags = [
        "--device",
        "vulkan",
        "--kv-cache-memory",
        "200000000",
        "--max-num-batched-tokens",
        "64",
        "--max-model-len",
        "1024",
    ];
    let plan = [
        &["plan", &smollm2, "--json", "--max-num-seqs", "1"][..],
        &flags,
    ]
    .concat();
    let v = json_of(&plan);
    let device = v["device"].as_str().unwrap();
    assert!(
        device.contains("(Vulkan, ") && device.contains("bindings up to "),
        "{device}"
    );
    assert_eq!(v["weight_format"], "Q4_1, Q8_0 blocks kept");
    let generate = ["generate", &smollm2, "--prompt", "hi", "--max-tokens", "1"];
    let (ok, err) = ferrite(&[&generate[..], &flags].concat());
    assert!(ok, "{err}");
    let line = err.lines().find(|l| l.contains("KV cache: ")).unwrap();
    assert_eq!(
        plan_figures(v["startup_line"].as_str().unwrap()),
        plan_figures(line)
    );
}

/// `ferrite plan` (header only) states the plan start-up makes: one request on SmolLM2
/// (`generate`, the pool capped at one max_model_len request), Gemma 3's window groups with
/// `--kv-cache-memory`, and the server at its defaults, where the budget bounds the pool and
/// only the activation estimate differs from start-up's measured step.
#[test]
fn plan_states_what_start_up_makes() {
    let (smollm2, gemma3) = (model_file("smollm2"), model_file("gemma3"));
    let plan_json = |model: &str, extra: &[&str]| {
        let mut args = vec!["plan", model, "--json"];
        args.extend_from_slice(extra);
        json_of(&args)
    };
    let plan = |model: &str, extra: &[&str]| {
        plan_figures(plan_json(model, extra)["startup_line"].as_str().unwrap())
    };
    let generate = |model: &str, extra: &[&str]| {
        let mut args = vec!["generate", model, "--prompt", "hi", "--max-tokens", "1"];
        args.extend_from_slice(extra);
        let (ok, err) = ferrite(&args);
        assert!(ok, "{err}");
        plan_figures(err.lines().find(|l| l.contains("KV cache: ")).unwrap())
    };
    assert_eq!(
        plan(&smollm2, &["--max-num-seqs", "1"]),
        generate(&smollm2, &[])
    );
    let kv = ["--kv-cache-memory", "200000000"];
    let gemma = plan(&gemma3, &[&kv[..], &["--max-num-seqs", "1"]].concat());
    assert_eq!(gemma, generate(&gemma3, &kv));
    assert_eq!(gemma.0, 200_000_000 / (16 * 2 * 256 * 2 * 3));
    // 8-bit K/V: a code per value and an f32 scale per token and head (256 + 4 bytes against
    // 512), the same in the plan and at start-up.
    for dtype in ["fp8", "int8"] {
        let args = [&kv[..], &["--kv-cache-dtype", dtype]].concat();
        let eight = plan(&gemma3, &[&args[..], &["--max-num-seqs", "1"]].concat());
        assert_eq!(eight, generate(&gemma3, &args), "{dtype}");
        assert_eq!(eight.0, 200_000_000 / (16 * 2 * (256 + 4) * 3), "{dtype}");
        // The table names the type planned and its bytes per token (one KV head, 3 layers).
        let v = plan_json(&gemma3, &args);
        assert_eq!(v["kv_cache"]["dtype"], dtype);
        assert_eq!(v["kv_groups"][0]["bytes_per_token"], 2 * (256 + 4) * 3);
    }
    let v = plan_json(&gemma3, &kv);
    assert_eq!(v["kv_cache"]["dtype"], "fp16");
    assert_eq!(v["kv_groups"][0]["bytes_per_token"], 2 * 256 * 2 * 3);
    // Matrices kept as the int8 kernels' codes, or as f32: GGUF blocks are repacked,
    // safetensors stay f32, `--weight-format f32` dequantizes.
    let formats = [
        (&smollm2, &[][..], "int8 kernels, repacked from Q4_1, Q8_0"),
        (&smollm2, &["--weight-format", "f32"][..], "f32"),
        (&model_file("minilm"), &[][..], "f32"),
    ];
    for (model, extra, label) in formats {
        assert_eq!(plan_json(model, extra)["weight_format"], label, "{model}");
    }
    // A draft model (here the target itself) takes its weights and its K/V in every block
    // from the same budget: half the blocks, and the plan line says so.
    let spec = format!(
        r#"{{"method": "draft_model", "model": "{smollm2}", "num_speculative_tokens": 3}}"#
    );
    let v = json_of(&[
        "plan",
        &smollm2,
        "--json",
        kv[0],
        kv[1],
        "--speculative-config",
        &spec,
        "--max-model-len",
        "2048",
    ]);
    let line = v["startup_line"].as_str().unwrap();
    let draft = &v["draft_model"];
    assert_eq!(
        plan_figures(line).0,
        200_000_000 / (2 * 16 * 2 * 30 * 192 * 2),
        "{line}"
    );
    assert_eq!(draft["bytes_per_block"], 16 * 2 * 30 * 192 * 2);
    assert_eq!(
        2 * draft["weight_bytes"].as_u64().unwrap(),
        v["weight_bytes"].as_u64().unwrap()
    );
    assert!(
        line.contains("of these, the draft model's: weights"),
        "{line}"
    );
    // The server at its defaults, stopped once it has stated its plan.
    let port = (20000 + std::process::id() % 20000).to_string();
    let mut server = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["serve", &smollm2, "--port", &port])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(server.stderr.take().unwrap());
    let line = std::io::BufRead::lines(stderr)
        .map(|l| l.unwrap())
        .find(|l| l.contains("KV cache: "))
        .expect("the server states its plan");
    let _ = server.kill();
    let _ = server.wait();
    let (served, planned) = (plan_figures(&line), plan(&smollm2, &[]));
    println!("served {served:?}, planned {planned:?}");
    assert_eq!(served.1, planned.1, "weights");
    let diff = served.0.abs_diff(planned.0) as f64 / served.0 as f64;
    assert!(diff < 0.01, "blocks {served:?} vs {planned:?}");
}
