//! A real browser for tests: Debian's headless Chromium driven through
//! its ChromeDriver over WebDriver (the W3C protocol: JSON over HTTP/1.1),
//! with a client small enough to keep here rather than pull in a crate.
//! Each [`Browser`] is a ChromeDriver process of its own, with a fresh
//! profile, killed when dropped.

use base64::Engine;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Where Debian puts them (`apt-get install chromium chromium-driver`).
pub const CHROMIUM: &str = "/usr/bin/chromium";
pub const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

pub struct Browser {
    driver: Child,
    port: u16,
    session: String,
    _profile: tempfile_dir::Dir,
}

/// A found element.
#[derive(Debug, Clone)]
pub struct Element(String);

mod tempfile_dir {
    /// A folder removed when dropped.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

impl Browser {
    /// Starts ChromeDriver and a headless Chromium session (self-signed
    /// and private-CA certificates accepted: the tests check the console's
    /// certificate with the region's CA themselves).
    pub async fn start() -> Browser {
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("start {CHROMEDRIVER} (apt-get install chromium-driver): {e}")
            });
        let profile =
            std::env::temp_dir().join(format!("strata-chromium-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&profile).expect("a profile folder");
        let mut b = Browser {
            driver,
            port,
            session: String::new(),
            _profile: tempfile_dir::Dir(profile.clone()),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not listen within 20 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "acceptInsecureCerts": true,
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--disable-quic", "--no-first-run", "--disable-background-networking",
                         "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                         format!("--user-data-dir={}", profile.display())]
            }
        }}});
        let v = b.call("POST", "/session", Some(caps)).await;
        b.session = v["sessionId"].as_str().expect("a session id").to_string();
        b
    }

    async fn call(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", self.port))
            .await
            .expect("connect to chromedriver");
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .await
            .expect("write to chromedriver");
        let (head, body) = tokio::time::timeout(Duration::from_secs(60), read_response(&mut s))
            .await
            .expect("chromedriver answers within 60 s");
        let v: Value = serde_json::from_slice(&body)
            .unwrap_or_else(|e| panic!("{head}\n{}: {e}", String::from_utf8_lossy(&body)));
        let value = v.get("value").cloned().unwrap_or(Value::Null);
        if let Some(err) = value.get("error") {
            panic!("webdriver {method} {path}: {err}: {}", value["message"]);
        }
        value
    }

    fn at(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    pub async fn goto(&self, url: &str) {
        self.call("POST", &self.at("/url"), Some(json!({ "url": url })))
            .await;
    }

    pub async fn url(&self) -> String {
        self.call("GET", &self.at("/url"), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    /// Sets a cookie for the page's site (the browser must be on it).
    pub async fn add_cookie(&self, name: &str, value: &str) {
        let cookie = json!({"cookie": {"name": name, "value": value, "path": "/", "secure": true, "httpOnly": true}});
        self.call("POST", &self.at("/cookie"), Some(cookie)).await;
    }

    /// The first element `css` selects, if any.
    pub async fn find(&self, css: &str) -> Option<Element> {
        let v = self
            .call(
                "POST",
                &self.at("/elements"),
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array()?
            .first()?
            .get(ELEMENT)?
            .as_str()
            .map(|s| Element(s.to_string()))
    }

    pub async fn text(&self, e: &Element) -> String {
        self.call("GET", &self.at(&format!("/element/{}/text", e.0)), None)
            .await
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub async fn click(&self, e: &Element) {
        self.call(
            "POST",
            &self.at(&format!("/element/{}/click", e.0)),
            Some(json!({})),
        )
        .await;
    }

    pub async fn clear_and_type(&self, e: &Element, text: &str) {
        self.call(
            "POST",
            &self.at(&format!("/element/{}/clear", e.0)),
            Some(json!({})),
        )
        .await;
        self.call(
            "POST",
            &self.at(&format!("/element/{}/value", e.0)),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Runs `script` (a function body; `arguments` are `args`) in the page.
    pub async fn run(&self, script: &str, args: Vec<Value>) -> Value {
        self.call(
            "POST",
            &self.at("/execute/sync"),
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    /// Runs `script` asynchronously: it ends by calling the last of its
    /// `arguments` with its result.
    pub async fn run_async(&self, script: &str) -> Value {
        self.call(
            "POST",
            &self.at("/execute/async"),
            Some(json!({ "script": script, "args": [] })),
        )
        .await
    }

    /// The text of the page's body.
    pub async fn page_text(&self) -> String {
        self.run(
            "return document.body ? document.body.innerText : '';",
            vec![],
        )
        .await
        .as_str()
        .unwrap_or_default()
        .to_string()
    }

    /// Waits until `check` holds of the page's text, or panics with it.
    pub async fn wait_text(&self, what: &str, secs: u64, check: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let t = self.page_text().await;
            if check(&t) {
                return t;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: not within {secs} s; the page says:\n{t}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A screenshot of the window, as PNG, written to `path`.
    pub async fn screenshot(&self, path: &Path) -> PathBuf {
        let v = self.call("GET", &self.at("/screenshot"), None).await;
        let png = base64::engine::general_purpose::STANDARD
            .decode(v.as_str().unwrap_or_default())
            .expect("a base64 screenshot");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("the screenshot's folder");
        }
        std::fs::write(path, png).expect("write the screenshot");
        path.to_path_buf()
    }
}

/// One HTTP/1.1 response: its head, and its body by `Content-Length` or
/// chunks (ChromeDriver may keep the connection open, so reading to its
/// end could wait forever).
async fn read_response(s: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = s.read(&mut chunk).await.expect("read from chromedriver");
        assert!(n > 0, "chromedriver closed the connection mid-answer");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let mut body = buf[end + 4..].to_vec();
    let header = |name: &str| {
        head.lines()
            .find_map(|l| {
                l.split_once(':')
                    .filter(|(k, _)| k.trim().eq_ignore_ascii_case(name))
            })
            .map(|(_, v)| v.trim().to_string())
    };
    if let Some(len) = header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        while body.len() < len {
            let n = s.read(&mut chunk).await.expect("read from chromedriver");
            assert!(n > 0, "chromedriver closed the connection mid-body");
            body.extend_from_slice(&chunk[..n]);
        }
        body.truncate(len);
        return (head, body);
    }
    // Chunked: read to the last chunk, then join the chunks.
    while !body.windows(5).any(|w| w == b"0\r\n\r\n") {
        let n = s.read(&mut chunk).await.expect("read from chromedriver");
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let mut out = Vec::new();
    let mut rest = &body[..];
    while let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
        let size =
            usize::from_str_radix(String::from_utf8_lossy(&rest[..i]).trim(), 16).unwrap_or(0);
        if size == 0 || rest.len() < i + 2 + size {
            break;
        }
        out.extend_from_slice(&rest[i + 2..i + 2 + size]);
        rest = &rest[(i + 4 + size).min(rest.len())..];
    }
    (head, out)
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ends the session (and its Chromium) before ChromeDriver itself.
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.port)) {
            use std::io::{Read, Write};
            let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
            let req = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                self.session
            );
            if s.write_all(req.as_bytes()).is_ok() {
                let mut sink = Vec::new();
                let _ = s.read_to_end(&mut sink);
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Whether Chromium and ChromeDriver are installed here.
pub fn available() -> bool {
    Path::new(CHROMIUM).exists() && Path::new(CHROMEDRIVER).exists()
}
