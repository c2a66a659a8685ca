//! The HTTP accept loop. Each connection is served by hyper and watched on a duplicate of its
//! socket, so the moment its client closes, the requests it carries stop: a queued request
//! with nothing written yet leaves the queue before it costs a step (hyper alone notices a
//! closed connection only when it next writes). A connection with no request in flight is
//! closed after `idle`, one whose request head does not arrive within `header` too, and on
//! shutdown every connection finishes its responses and closes.

use axum::body::{Body, HttpBody};
use axum::http::{Request, Response, StatusCode};
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::ServiceExt;

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// A connection with no request in flight for this long is closed.
    pub idle: Duration,
    /// A request head must arrive whole within this.
    pub header: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves, then lets every connection finish
/// the responses it is sending and returns once all are closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()>,
) {
    let (close_tx, close_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(connection(stream, router.clone(), timeouts, close_rx.clone()));
                }
                // Out of file descriptors and the like: the listener itself is fine.
                Err(e) => {
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = close_tx.send(true);
    while connections.join_next().await.is_some() {}
}

/// Resolves once the client of this request's connection has closed it (in every request's
/// extensions).
#[derive(Clone)]
pub struct ClientGone(watch::Receiver<bool>);

impl ClientGone {
    pub async fn wait(mut self) {
        // An error means the connection task ended: its client is gone too.
        let _ = self.0.wait_for(|&gone| gone).await;
    }
}

/// Requests of one connection not yet answered to the end, and since when there were none.
#[derive(Default)]
struct Activity {
    in_flight: usize,
    idle_since: Option<Instant>,
}

/// Held by a request from its head to the end of its response body.
struct Busy(Arc<Mutex<Activity>>);

impl Busy {
    fn new(a: &Arc<Mutex<Activity>>) -> Self {
        a.lock().unwrap().in_flight += 1;
        Busy(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut a = self.0.lock().unwrap();
        a.in_flight -= 1;
        if a.in_flight == 0 {
            a.idle_since = Some(Instant::now());
        }
    }
}

async fn connection(
    stream: TcpStream,
    router: Router,
    timeouts: Timeouts,
    mut close: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let peer = match watchable(&stream) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("cannot watch a connection: {e}");
            return;
        }
    };
    let (gone_tx, gone_rx) = watch::channel(false);
    let activity = Arc::new(Mutex::new(Activity {
        in_flight: 0,
        idle_since: Some(Instant::now()),
    }));
    let a = activity.clone();
    let service = tower::service_fn(move |req: Request<Incoming>| {
        let mut req = req.map(Body::new);
        let gone = ClientGone(gone_rx.clone());
        req.extensions_mut().insert(gone.clone());
        let busy = Busy::new(&a);
        let router = router.clone();
        async move {
            // The handler's future, with every engine request it holds, is dropped (and the
            // requests aborted) as soon as the client is gone.
            let response = tokio::select! {
                r = router.oneshot(req) => r?,
                _ = gone.clone().wait() => Response::builder()
                    .status(StatusCode::from_u16(499).unwrap())
                    .body(Body::empty())
                    .unwrap(),
            };
            Ok::<_, std::convert::Infallible>(response.map(|body| {
                Body::new(Watched {
                    body,
                    gone: Box::pin(gone.wait()),
                    _busy: busy,
                })
            }))
        }
    });
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header);
    let conn = builder
        .serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(service));
    tokio::pin!(conn);
    let watch = peer_closed(peer);
    tokio::pin!(watch);
    let mut ticks = tokio::time::interval(Duration::from_millis(250));
    let (mut gone, mut closing) = (false, false);
    loop {
        tokio::select! {
            _ = conn.as_mut() => break,
            _ = &mut watch, if !gone => {
                gone = true;
                let _ = gone_tx.send(true);
            }
            _ = close.wait_for(|&c| c), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = ticks.tick() => {
                let a = activity.lock().unwrap();
                if a.in_flight == 0 && a.idle_since.is_some_and(|t| t.elapsed() >= timeouts.idle) {
                    // Dropping the connection closes its socket: nothing is owed on it.
                    break;
                }
            }
        }
    }
}

/// A second handle on the connection's socket, registered with the runtime on its own, to
/// see the peer's end of stream without reading what hyper has yet to read.
fn watchable(stream: &TcpStream) -> std::io::Result<TcpStream> {
    let dup = std::net::TcpStream::from(stream.as_fd().try_clone_to_owned()?);
    dup.set_nonblocking(true)?;
    TcpStream::from_std(dup)
}

/// Resolves once the peer has closed (or reset) the connection.
async fn peer_closed(peer: TcpStream) {
    let mut byte = [0u8; 1];
    loop {
        match peer.peek(&mut byte).await {
            Ok(0) | Err(_) => return,
            // Bytes hyper has not read yet (a request still arriving, or the next one).
            Ok(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A response body that ends as soon as the client is gone (dropping what produces it:
/// a stream's engine requests are aborted) and marks the request done when it ends.
struct Watched {
    body: Body,
    gone: Pin<Box<dyn Future<Output = ()> + Send>>,
    _busy: Busy,
}

impl HttpBody for Watched {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        if self.gone.as_mut().poll(cx).is_ready() {
            self.body = Body::empty();
            return Poll::Ready(None);
        }
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
