//! The HTTP client of the load tool and the tests: hyper's (the client half of the library the
//! server runs on), one connection per request, plus server-sent events read as they arrive.

use anyhow::{bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// A whole response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| format!("response is not JSON: {}", self.text()))
    }
}

fn find_header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// A response whose body is read on demand.
pub struct ResponseStream {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    body: hyper::body::Incoming,
    done: bool,
    /// Body bytes read but not yet consumed as SSE events.
    pending: Vec<u8>,
}

/// Sends one request to `addr` (`host:port`) and reads the response head.
pub async fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<ResponseStream> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build_http();
    let mut req = hyper::Request::builder()
        .method(hyper::Method::from_bytes(method.as_bytes()).with_context(|| format!("bad method `{method}`"))?)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).context("building the request")?;
    let resp = client.request(req).await.with_context(|| format!("cannot reach {addr}"))?;
    let status = resp.status().as_u16();
    let headers = resp
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_string(), String::from_utf8_lossy(v.as_bytes()).into_owned()))
        .collect();
    Ok(ResponseStream { status, headers, body: resp.into_body(), done: method == "HEAD", pending: Vec::new() })
}

/// Sends one request and reads the whole response.
pub async fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Result<Response> {
    let stream = send(addr, method, path, headers, body).await?;
    stream.into_response().await
}

/// POSTs a JSON body.
pub async fn post_json(addr: &str, path: &str, headers: &[(&str, &str)], body: &Value) -> Result<Response> {
    let mut h = vec![("Content-Type", "application/json")];
    h.extend_from_slice(headers);
    request(addr, "POST", path, &h, body.to_string().as_bytes()).await
}

impl ResponseStream {
    pub fn header(&self, name: &str) -> Option<&str> {
        find_header(&self.headers, name)
    }

    /// The next piece of the body, or None at its end.
    pub async fn read_some(&mut self) -> Result<Option<Vec<u8>>> {
        while !self.done {
            match self.body.frame().await {
                None => self.done = true,
                Some(frame) => {
                    if let Ok(data) = frame.context("reading the response body")?.into_data() {
                        return Ok(Some(data.to_vec()));
                    }
                }
            }
        }
        Ok(None)
    }

    /// Reads the rest of the body.
    pub async fn into_response(mut self) -> Result<Response> {
        let mut body = std::mem::take(&mut self.pending);
        while let Some(piece) = self.read_some().await? {
            body.extend_from_slice(&piece);
        }
        Ok(Response { status: self.status, headers: self.headers, body })
    }

    /// The `data` of the next server-sent event, or None when the body ends.
    pub async fn next_event(&mut self) -> Result<Option<String>> {
        loop {
            if let Some(end) = find_event_end(&self.pending) {
                let block: Vec<u8> = self.pending.drain(..end.0 + end.1).collect();
                let text = String::from_utf8_lossy(&block[..end.0]).into_owned();
                let data: Vec<&str> = text
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:").map(|d| d.strip_prefix(' ').unwrap_or(d)))
                    .collect();
                if data.is_empty() {
                    continue; // a comment or a field-only event
                }
                return Ok(Some(data.join("\n")));
            }
            match self.read_some().await? {
                Some(piece) => self.pending.extend_from_slice(&piece),
                None => return Ok(None),
            }
        }
    }
}

/// Position and length of the blank line that ends the first event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|p| (p, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|p| (p, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

/// `http://host:port` → `host:port`, refusing anything but loopback addresses (the load tool
/// must never send traffic elsewhere).
pub fn loopback_addr(url: &str) -> Result<String> {
    let rest = url.strip_prefix("http://").context("only http:// URLs are supported")?;
    let hostport = rest.split('/').next().unwrap_or("");
    let (host, port) = match hostport.find(']') {
        Some(end) => {
            let (h, rest) = hostport.split_at(end + 1);
            (h, rest.strip_prefix(':').unwrap_or("80"))
        }
        None => hostport.rsplit_once(':').unwrap_or((hostport, "80")),
    };
    let port: u16 = port.parse().with_context(|| format!("bad port in `{url}`"))?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let loopback = bare == "localhost" || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    if !loopback {
        bail!(
            "`{host}` is not a loopback address; the load tool only targets this machine (127.0.0.1, localhost, [::1])"
        );
    }
    Ok(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_urls() {
        assert_eq!(loopback_addr("http://127.0.0.1:8080").unwrap(), "127.0.0.1:8080");
        assert_eq!(loopback_addr("http://localhost:9/v1").unwrap(), "localhost:9");
        assert_eq!(loopback_addr("http://[::1]:7").unwrap(), "[::1]:7");
        assert_eq!(loopback_addr("http://127.0.0.2").unwrap(), "127.0.0.2:80");
        assert!(loopback_addr("http://10.0.0.1:8080").is_err());
        assert!(loopback_addr("http://example.com:80").is_err());
        assert!(loopback_addr("https://127.0.0.1:1").is_err());
    }

    #[test]
    fn finds_event_ends() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some((7, 2)));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some((7, 4)));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }

    #[test]
    fn reads_chunked_sse_and_length_bodies_from_a_socket() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            tokio::spawn(async move {
                for reply in [
                    &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: a\n\n\r\nf\r\ndata: b\ndata: c\r\n2\r\n\n\n\r\n0\r\n\r\n"[..],
                    &b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\n{}"[..],
                ] {
                    let (mut s, _) = listener.accept().await.unwrap();
                    let mut buf = [0u8; 1024];
                    let _ = s.read(&mut buf).await.unwrap();
                    s.write_all(reply).await.unwrap();
                }
            });
            let mut r = send(&addr, "POST", "/x", &[], b"{}").await.unwrap();
            assert_eq!(r.status, 200);
            assert_eq!(r.next_event().await.unwrap().as_deref(), Some("a"));
            assert_eq!(r.next_event().await.unwrap().as_deref(), Some("b\nc"));
            assert_eq!(r.next_event().await.unwrap(), None);
            let r = request(&addr, "GET", "/y", &[], b"").await.unwrap();
            assert_eq!((r.status, r.text().as_str()), (404, "{}"));
        });
    }
}
