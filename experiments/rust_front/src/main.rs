//! Experiment T6 (experiments/docs/fixed-throughput.md): a compiled HTTP/1.1 front for ferry's
//! fixed route that hands the Python core whole batches, as Mosec's Rust front does.
//!
//! It accepts and parses HTTP (hyper 0.14, the version Debian 12 packages, keep-alive, loopback only), checks the API key against
//! the sha256 digests it was given (ferry keeps keys only as digests), answers 401/404/405/413
//! itself, and forwards every accepted request's (id, key index, body) over one Unix socket to
//! `experiments/front_batched.py`. Framing, both ways: a 4-byte little-endian length, then one
//! msgpack value.
//!
//!   to the core:   [[[id, key, body], ...], [cancelled id, ...]]
//!   to the front:  [[id, status, body], ...]
//!
//! Batching is natural, with no timer: whatever arrived while the previous frame was being
//! written goes as the next frame. A request whose connection closes before its answer (its
//! handler future dropped) sends its id as cancelled, so the core can take the job back.
//!
//! One thread (tokio's current-thread runtime): on a machine whose cores the workers need, a
//! second front thread would only add wake-ups between threads.
//!
//! Usage: ferry-rust-front --core SOCKET --keys FILE [--listen 127.0.0.1:0] [--max-body BYTES]
//!        [--gather-us MICROSECONDS]
//! where FILE holds one hex sha256 digest a line (the key index is the line number).

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use hyper::body::HttpBody;
use hyper::header::{HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE};
use hyper::server::conn::Http;
use hyper::service::service_fn;
use hyper::{Body, Method, Request, Response, StatusCode};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, UnixStream};
use tokio::sync::{oneshot, Notify};

type Answer = (u16, Bytes);

/// Requests accepted and cancellations seen since the last frame went to the core.
#[derive(Default)]
struct Outbox {
    requests: Vec<(u64, u16, Bytes)>,
    cancels: Vec<u64>,
}

struct Front {
    keys: HashMap<[u8; 32], u16>,
    max_body: u64,
    next_id: AtomicU64,
    outbox: Mutex<Outbox>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    wake: Notify,
}

impl Front {
    fn forward(&self, key: u16, body: Bytes) -> (u64, oneshot::Receiver<Answer>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.waiting.lock().unwrap().insert(id, tx);
        self.outbox.lock().unwrap().requests.push((id, key, body));
        self.wake.notify_one();
        (id, rx)
    }

    fn cancel(&self, id: u64) {
        if self.waiting.lock().unwrap().remove(&id).is_some() {
            self.outbox.lock().unwrap().cancels.push(id);
            self.wake.notify_one();
        }
    }
}

/// Sends the request's id as cancelled if its handler is dropped before the answer came.
struct Pending<'a> {
    front: &'a Front,
    id: u64,
    answered: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.front.cancel(self.id);
        }
    }
}

fn error(status: u16, kind: &str, message: &str) -> Response<Body> {
    let body = format!(r#"{{"type":"error","error":{{"type":"{kind}","message":"{message}"}}}}"#);
    reply(status, Bytes::from(body))
}

fn reply(status: u16, body: Bytes) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The key a request presents: `x-api-key`, else an `Authorization: Bearer` token.
fn presented_key(headers: &HeaderMap) -> Option<&[u8]> {
    if let Some(key) = headers.get("x-api-key") {
        let key = key.as_bytes().trim_ascii();
        if !key.is_empty() {
            return Some(key);
        }
    }
    let value = headers.get(AUTHORIZATION)?.as_bytes();
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, token) = (&value[..space], value[space + 1..].trim_ascii());
    (scheme.eq_ignore_ascii_case(b"bearer") && !token.is_empty()).then_some(token)
}

async fn handle(front: Arc<Front>, request: Request<Body>) -> Result<Response<Body>, Infallible> {
    if request.uri().path() != "/v1/messages" {
        return Ok(error(404, "not_found_error", "no such route"));
    }
    if request.method() != Method::POST {
        return Ok(error(405, "invalid_request_error", "method not allowed"));
    }
    let key = presented_key(request.headers()).and_then(|key| front.keys.get(&<[u8; 32]>::from(Sha256::digest(key))));
    let Some(&key) = key else {
        return Ok(error(401, "authentication_error", "invalid x-api-key"));
    };
    let declared = request.headers().get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > front.max_body) {
        return Ok(error(413, "request_too_large", "request body too large"));
    }
    let body = match read_body(request.into_body(), front.max_body).await {
        Ok(Some(body)) => body,
        Ok(None) => return Ok(error(413, "request_too_large", "request body too large")),
        Err(_) => return Ok(error(400, "invalid_request_error", "the body could not be read")),
    };
    let (id, answer) = front.forward(key, body);
    let mut pending = Pending { front: &front, id, answered: false };
    let outcome = answer.await;
    pending.answered = true;
    Ok(match outcome {
        Ok((status, body)) => reply(status, body),
        Err(_) => error(503, "api_error", "the core went away"),
    })
}

/// The whole body, or None once it passes `limit` bytes (a chunked body has no length to check first).
async fn read_body(mut body: Body, limit: u64) -> Result<Option<Bytes>, hyper::Error> {
    let first = match body.data().await {
        None => return Ok(Some(Bytes::new())),
        Some(chunk) => chunk?,
    };
    if body.is_end_stream() {
        return Ok((first.len() as u64 <= limit).then_some(first)); // the usual case: no copy
    }
    let mut whole = BytesMut::from(&first[..]);
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        if (whole.len() + chunk.len()) as u64 > limit {
            return Ok(None);
        }
        whole.extend_from_slice(&chunk);
    }
    Ok((whole.len() as u64 <= limit).then(|| whole.freeze()))
}

/// msgpack, the few shapes the frames use (rmp's writers cannot fail on a Vec).
fn frame_of(outbox: &Outbox, frame: &mut Vec<u8>) {
    frame.clear();
    frame.extend_from_slice(&[0; 4]);
    rmp::encode::write_array_len(frame, 2).unwrap();
    rmp::encode::write_array_len(frame, outbox.requests.len() as u32).unwrap();
    for (id, key, body) in &outbox.requests {
        rmp::encode::write_array_len(frame, 3).unwrap();
        rmp::encode::write_uint(frame, *id).unwrap();
        rmp::encode::write_uint(frame, u64::from(*key)).unwrap();
        rmp::encode::write_bin(frame, body).unwrap();
    }
    rmp::encode::write_array_len(frame, outbox.cancels.len() as u32).unwrap();
    for id in &outbox.cancels {
        rmp::encode::write_uint(frame, *id).unwrap();
    }
    let length = (frame.len() - 4) as u32;
    frame[..4].copy_from_slice(&length.to_le_bytes());
}

/// Every frame goes as soon as the previous one is written: what arrived meanwhile rides together.
/// `gather`: if not zero, wait that long after the first request before taking the outbox (a
/// timer, to measure what a fuller frame saves; the default 0 is natural batching alone).
async fn write_frames(front: Arc<Front>, mut core: OwnedWriteHalf, gather: Duration) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(1 << 16);
    let mut taken = Outbox::default();
    loop {
        front.wake.notified().await;
        if !gather.is_zero() {
            tokio::time::sleep(gather).await;
        }
        {
            let mut outbox = front.outbox.lock().unwrap();
            std::mem::swap(&mut *outbox, &mut taken);
        }
        if taken.requests.is_empty() && taken.cancels.is_empty() {
            continue;
        }
        frame_of(&taken, &mut frame);
        taken.requests.clear();
        taken.cancels.clear();
        core.write_all(&frame).await?;
    }
}

fn answers_of(frame: Bytes) -> Result<Vec<(u64, Answer)>, String> {
    let mut rest: &[u8] = &frame;
    let bad = |what: &str| format!("bad answer frame: {what}");
    let count = rmp::decode::read_array_len(&mut rest).map_err(|_| bad("not an array"))?;
    let mut answers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        if rmp::decode::read_array_len(&mut rest).map_err(|_| bad("an answer is not an array"))? != 3 {
            return Err(bad("an answer is not [id, status, body]"));
        }
        let id: u64 = rmp::decode::read_int(&mut rest).map_err(|_| bad("id"))?;
        let status: u16 = rmp::decode::read_int(&mut rest).map_err(|_| bad("status"))?;
        let length = rmp::decode::read_bin_len(&mut rest).map_err(|_| bad("body"))? as usize;
        if length > rest.len() {
            return Err(bad("body past the frame's end"));
        }
        let start = frame.len() - rest.len();
        answers.push((id, (status, frame.slice(start..start + length))));
        rest = &rest[length..];
    }
    Ok(answers)
}

async fn read_answers(front: Arc<Front>, mut core: OwnedReadHalf) -> Result<(), String> {
    let mut head = [0u8; 4];
    loop {
        core.read_exact(&mut head).await.map_err(|e| format!("the core closed: {e}"))?;
        let mut frame = vec![0u8; u32::from_le_bytes(head) as usize];
        core.read_exact(&mut frame).await.map_err(|e| format!("the core closed mid-frame: {e}"))?;
        let answers = answers_of(Bytes::from(frame))?;
        let mut waiting = front.waiting.lock().unwrap();
        for (id, answer) in answers {
            if let Some(tx) = waiting.remove(&id) {
                let _ = tx.send(answer); // its client may have gone meanwhile
            }
        }
    }
}

fn digest_of(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim().as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (i, pair) in hex.chunks(2).enumerate() {
        digest[i] = u8::from_str_radix(std::str::from_utf8(pair).ok()?, 16).ok()?;
    }
    Some(digest)
}

struct Args {
    listen: String,
    core: String,
    keys: String,
    max_body: u64,
    gather: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args { listen: "127.0.0.1:0".into(), core: String::new(), keys: String::new(), max_body: 4 << 20, gather: Duration::ZERO };
    let mut argv = std::env::args().skip(1);
    while let Some(flag) = argv.next() {
        let value = argv.next().ok_or(format!("{flag}: needs a value"))?;
        match flag.as_str() {
            "--listen" => args.listen = value,
            "--core" => args.core = value,
            "--keys" => args.keys = value,
            "--max-body" => args.max_body = value.parse().map_err(|_| format!("--max-body: not a number: {value}"))?,
            "--gather-us" => {
                args.gather = Duration::from_micros(value.parse().map_err(|_| format!("--gather-us: not a number: {value}"))?)
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.core.is_empty() || args.keys.is_empty() {
        return Err("usage: ferry-rust-front --core SOCKET --keys FILE [--listen ADDR] [--max-body BYTES] [--gather-us N]".into());
    }
    Ok(args)
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("rust_front: {e}");
        std::process::exit(2)
    });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build().expect("a tokio runtime");
    if let Err(e) = runtime.block_on(serve(args)) {
        eprintln!("rust_front: {e}");
        std::process::exit(1);
    }
}

async fn serve(args: Args) -> Result<(), String> {
    let text = std::fs::read_to_string(&args.keys).map_err(|e| format!("--keys {}: {e}", args.keys))?;
    let mut keys = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let digest = digest_of(line).ok_or(format!("--keys line {}: not a hex sha256 digest", index + 1))?;
        keys.insert(digest, index as u16);
    }
    let front = Arc::new(Front {
        keys,
        max_body: args.max_body,
        next_id: AtomicU64::new(0),
        outbox: Mutex::default(),
        waiting: Mutex::default(),
        wake: Notify::new(),
    });
    let core = UnixStream::connect(&args.core).await.map_err(|e| format!("--core {}: {e}", args.core))?;
    let (from_core, to_core) = core.into_split();
    let listener = TcpListener::bind(&args.listen).await.map_err(|e| format!("--listen {}: {e}", args.listen))?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    if !address.ip().is_loopback() {
        return Err(format!("--listen: loopback only, got {address}"));
    }
    println!("rust_front: pid {} listening on http://{address}", std::process::id());
    let writer = tokio::spawn(write_frames(front.clone(), to_core, args.gather));
    let reader = tokio::spawn(read_answers(front.clone(), from_core));
    let accepting = async {
        loop {
            let Ok((stream, _)) = listener.accept().await else { continue };
            let _ = stream.set_nodelay(true);
            let front = front.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| handle(front.clone(), request));
                let _ = Http::new().http1_only(true).serve_connection(stream, service).await;
            });
        }
    };
    tokio::select! {
        () = accepting => Ok(()),
        outcome = writer => Err(format!("writing to the core: {outcome:?}")),
        outcome = reader => Err(format!("reading from the core: {outcome:?}")),
    }
}
