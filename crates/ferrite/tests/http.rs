//! The real `ferrite serve` binary on the real model, driven by a Rust HTTP client.

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn model() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg(root.join("scripts/fetch-model.sh"))
        .output()
        .expect("fetch-model.sh");
    assert!(out.status.success());
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn start() -> Server {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args([
            "serve",
            model().to_str().unwrap(),
            "--port",
            &port.to_string(),
        ])
        .args(["--max-model-len", "1024", "--kv-cache-memory", "100000000"])
        .args(["--served-model-name", "smol", "--log-level", "warn"])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let s = Server {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let t0 = Instant::now();
    while ureq::get(&format!("{}/health", s.url)).call().is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "server did not start"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    s
}

fn post(s: &Server, route: &str, body: Value) -> (u16, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent
        .post(&format!("{}{route}", s.url))
        .send_json(&body)
        .unwrap();
    (r.status().as_u16(), r.body_mut().read_json().unwrap())
}

#[test]
fn chat_streamed_and_whole_agree_and_errors_are_openai_shaped() {
    let s = start();
    let ask = json!([{"role": "user", "content": "What is the capital of Germany?"}]);
    let (status, whole) = post(
        &s,
        "/v1/chat/completions",
        json!({"model": "smol", "messages": ask, "max_tokens": 20, "temperature": 0}),
    );
    assert_eq!(status, 200);
    let content = whole["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("Berlin"), "{content}");
    let body = json!({"messages": ask, "max_tokens": 20, "temperature": 0, "stream": true});
    let r = ureq::post(&format!("{}/v1/chat/completions", s.url))
        .send_json(&body)
        .unwrap();
    let mut streamed = String::new();
    let mut done = false;
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        streamed += chunk["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap_or("");
    }
    assert!(done);
    assert_eq!(streamed, content);

    let (status, err) = post(
        &s,
        "/v1/completions",
        json!({"prompt": "hi", "max_tokens": -1}),
    );
    assert_eq!(status, 400);
    assert_eq!(err["error"]["type"], "BadRequestError");
    assert!(err["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens"));
    assert_eq!(err["error"]["code"], 400);
    let long = "word ".repeat(1500);
    let (status, err) = post(
        &s,
        "/v1/completions",
        json!({"prompt": long, "max_tokens": 4}),
    );
    assert_eq!(status, 400);
    let msg = err["error"]["message"].as_str().unwrap();
    assert!(msg.contains("maximum context length is 1024"), "{msg}");
    let (status, _) = post(
        &s,
        "/v1/completions",
        json!({"model": "other", "prompt": "hi"}),
    );
    assert_eq!(status, 404);
}
