//! One Redis server or a Redis Cluster, behind one connection type.
//!
//! Everything else in the crate talks to a [`RedisConn`]. On a single server
//! it is a plain connection; on a cluster, redis-rs routes every command to
//! the node that owns its key's hash slot and follows `MOVED`/`ASK`
//! redirections after a resharding or a failover.
//!
//! What a cluster changes for us:
//! - A stream and its dead-letter stream (`<stream>:dlq`) must share a hash
//!   slot, because the dead letter and the ack are written by one Lua script:
//!   streams are named with a hash tag, like `{orders}` or `{orders}:events`.
//!   [`check_slots`] refuses other names with a message that says so.
//! - The duplicate markers (`processed:<scope>:<event_id>`) spread over all
//!   slots: a pipeline of them is a [`Pipe`], which on a cluster sends one
//!   pipeline per node (in parallel on the wire, one round trip each).

use std::time::Duration;

use redis::cluster::{ClusterClient, ClusterConnection, ClusterPipeline};
use redis::{Cmd, ConnectionLike, FromRedisValue, RedisResult, ToRedisArgs, Value};

use crate::connect::{is_tls_url, redact, CONNECT_TIMEOUT, REDIS_COMMAND_TIMEOUT};
use crate::error::{Error, ErrorKind};
use crate::tls::Tls;

/// A connection to one Redis server or to a Redis Cluster.
pub enum RedisConn {
    /// One server (`redis://` or `rediss://`).
    Single(redis::Connection),
    /// A cluster: connections to the nodes, opened as they are needed.
    Cluster {
        /// redis-rs' cluster connection, with its map of the slots.
        conn: Box<ClusterConnection>,
        /// Set when a pipeline failed (see [`Pipe::query`]): the pool drops
        /// this connection and the next one starts afresh.
        stale: bool,
    },
}

impl RedisConn {
    /// An empty pipeline of the right kind for this connection.
    pub fn pipe(&self) -> Pipe {
        match self {
            RedisConn::Single(_) => Pipe {
                inner: Inner::Single(redis::pipe()),
                len: 0,
                ignored: Vec::new(),
            },
            RedisConn::Cluster { .. } => Pipe {
                inner: Inner::Cluster(redis::cluster::cluster_pipe()),
                len: 0,
                ignored: Vec::new(),
            },
        }
    }

    /// Whether this is a cluster connection.
    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisConn::Cluster { .. })
    }

    /// On a cluster, checks that `stream` and its dead-letter stream share a
    /// hash slot (see the module's documentation); nothing to check on one
    /// server.
    pub fn check_stream(&self, stream: &str) -> Result<(), Error> {
        if self.is_cluster() {
            check_slots(std::slice::from_ref(&stream.to_owned()))?;
        }
        Ok(())
    }

    /// Whether the pool should drop this connection: closed, or (cluster)
    /// with an out-of-date slot map.
    pub(crate) fn is_broken(&self) -> bool {
        match self {
            RedisConn::Single(c) => !c.is_open(),
            RedisConn::Cluster { conn, stale } => *stale || !conn.is_open(),
        }
    }

    fn set_read_timeout(&self, timeout: Duration) -> RedisResult<()> {
        match self {
            RedisConn::Single(c) => c.set_read_timeout(Some(timeout)),
            RedisConn::Cluster { conn: c, .. } => c.set_read_timeout(Some(timeout)),
        }
    }
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Single(_) => "RedisConn::Single",
            RedisConn::Cluster { .. } => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            RedisConn::Single(c) => c.req_packed_command(cmd),
            RedisConn::Cluster { conn, stale } => lost_if_cut(conn.req_packed_command(cmd), stale),
        }
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        match self {
            RedisConn::Single(c) => c.req_packed_commands(cmd, offset, count),
            // A MULTI/EXEC block goes to the node of its first key.
            RedisConn::Cluster { conn, stale } => {
                lost_if_cut(conn.req_packed_commands(cmd, offset, count), stale)
            }
        }
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            RedisConn::Single(c) => c.req_command(cmd),
            RedisConn::Cluster { conn, stale } => lost_if_cut(conn.req_command(cmd), stale),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single(c) => c.get_db(),
            RedisConn::Cluster { conn: c, .. } => c.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            RedisConn::Single(c) => c.check_connection(),
            RedisConn::Cluster { conn: c, .. } => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            RedisConn::Single(c) => c.is_open(),
            RedisConn::Cluster { conn: c, .. } => c.is_open(),
        }
    }
}

/// A pipeline for a [`RedisConn`] (made by [`RedisConn::pipe`]): one round
/// trip on a single server; on a cluster, the commands grouped by node, one
/// round trip per node. Not a transaction: atomic steps are Lua scripts.
///
/// On a cluster, a pipeline that meets `MOVED` or `ASK` (a failover, a
/// resharding) is sent again, whole, one command at a time, which redis-rs
/// routes afresh: the commands that had succeeded run a second time. So
/// every command in a pipeline must be safe to send twice. Ours are reads,
/// `SET`s, `XACK`s, scripts that check before they write (a dead letter
/// written by the first send answers "not pending" to the second), and the
/// producer's `XADD`s (an entry can be added twice; its event_id makes the
/// second a duplicate for the workers).
pub struct Pipe {
    inner: Inner,
    /// Commands added so far.
    len: usize,
    /// Positions of the commands whose replies are left out (cluster only:
    /// needed to send the commands one at a time).
    ignored: Vec<usize>,
}

enum Inner {
    Single(redis::Pipeline),
    Cluster(ClusterPipeline),
}

macro_rules! both {
    ($self:ident, $p:ident => $e:expr) => {{
        match &mut $self.inner {
            Inner::Single($p) => {
                $e;
            }
            Inner::Cluster($p) => {
                $e;
            }
        }
        $self
    }};
}

impl Pipe {
    /// Starts a new command.
    pub fn cmd(&mut self, name: &str) -> &mut Pipe {
        self.len += 1;
        both!(self, p => p.cmd(name))
    }

    /// Adds an argument to the last command.
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Pipe {
        both!(self, p => p.arg(&arg))
    }

    /// Adds a built command.
    pub fn add_command(&mut self, cmd: Cmd) -> &mut Pipe {
        self.len += 1;
        both!(self, p => p.add_command(cmd))
    }

    /// Leaves the last command's reply out of the result.
    pub fn ignore(&mut self) -> &mut Pipe {
        if matches!(self.inner, Inner::Cluster(_)) && self.len > 0 {
            self.ignored.push(self.len - 1);
        }
        both!(self, p => p.ignore())
    }

    /// Whether no command was added.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sends the commands and returns their replies.
    pub fn query<T: FromRedisValue>(&self, conn: &mut RedisConn) -> RedisResult<T> {
        if self.len == 0 {
            // As on one server; redis-rs' cluster pipeline refuses it.
            return Ok(redis::from_redis_value(Value::Array(Vec::new()))?);
        }
        match (&self.inner, conn) {
            (Inner::Single(p), c) => p.query(c),
            (Inner::Cluster(p), RedisConn::Cluster { conn, stale }) => match p.query(conn) {
                // redis-rs follows a redirection for a single command (and
                // updates its slot map), but a pipeline only reports it.
                Err(e) if is_only_redirections(&e) => {
                    log::debug!(
                        "redis: pipeline redirected ({e}); sending its {} commands one at a time",
                        self.len
                    );
                    let mut replies = Vec::with_capacity(self.len);
                    for (i, cmd) in p.cmd_iter().enumerate() {
                        let reply: Value = lost_if_cut(cmd.query(conn.as_mut()), stale)?;
                        if !self.ignored.contains(&i) {
                            replies.push(reply);
                        }
                    }
                    Ok(redis::from_redis_value(Value::Array(replies))?)
                }
                // A pipeline cut short on one node can leave replies unread
                // on another, which the next command would take for its own
                // (seen in tests/cluster.rs: markers read as present after a
                // node restart, so events skipped as duplicates): after such
                // a failure the connection is dropped.
                result => lost_if_cut(result, stale),
            },
            (Inner::Cluster(_), RedisConn::Single(_)) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a cluster pipeline sent on a single-server connection",
            ))),
        }
    }
}

/// Marks a cluster connection `stale` when `result` is a broken exchange
/// (I/O error, timeout) rather than an error reply: replies may be left
/// unread on one of its node connections.
fn lost_if_cut<T>(result: RedisResult<T>, stale: &mut bool) -> RedisResult<T> {
    if let Err(e) = &result {
        if !is_reply(e) {
            *stale = true;
        }
    }
    result
}

/// Whether `e` is an error reply from the server (of a command or of some
/// commands of a pipeline; every reply was read), not a broken exchange.
fn is_reply(e: &redis::RedisError) -> bool {
    e.clone().into_server_errors().is_some()
}

/// Whether `e` (or one command of a failed pipeline) is a `MOVED` or `ASK`.
pub(crate) fn is_redirection(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind::{Ask, Moved};
    e.clone().into_server_errors().is_some_and(|errors| {
        errors
            .iter()
            .any(|(_, err)| matches!(err.kind(), Some(Moved | Ask)))
    })
}

/// Whether every failed command of `e` is a `MOVED` or `ASK`.
fn is_only_redirections(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind::{Ask, Moved};
    e.clone().into_server_errors().is_some_and(|errors| {
        !errors.is_empty()
            && errors
                .iter()
                .all(|(_, err)| matches!(err.kind(), Some(Moved | Ask)))
    })
}

/// Where connections come from: one server or a cluster, found out when
/// opened.
#[derive(Clone)]
pub(crate) enum RedisClient {
    Single(redis::Client),
    Cluster(ClusterClient),
}

impl RedisClient {
    /// Opens `url`: one URL, or several separated by commas (the seed nodes
    /// of a cluster). With one URL, asks the server (`INFO cluster`) whether
    /// it is a cluster node, so the same `--redis-url` works when a single
    /// server grows into a cluster. `rediss://` URLs use `tls` (one server
    /// and a cluster alike). Fails when the server cannot be reached.
    pub fn open(url: &str, tls: &Tls) -> Result<RedisClient, Error> {
        let urls: Vec<&str> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if !tls.is_default() && urls.first().is_some_and(|u| !is_tls_url(u)) {
            log::warn!("redis: TLS files are set but the URL is not rediss://; they are not used");
        }
        let first = match urls.as_slice() {
            [] => {
                return Err(Error::new(ErrorKind::Config, "the Redis URL is empty"));
            }
            [one] => *one,
            many => return cluster_client(url, many, tls),
        };
        let client = crate::connect::redis_client(first, tls)?;
        let mut conn = client
            .get_connection_with_timeout(CONNECT_TIMEOUT)
            .and_then(|c| {
                c.set_read_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                Ok(c)
            })
            .map_err(|e| crate::connect::redis_unreachable(url, e))?;
        let cluster = match redis::cmd("INFO").arg("cluster").query::<String>(&mut conn) {
            Ok(info) => info.contains("cluster_enabled:1"),
            // INFO (@dangerous) may be refused to an ACL user; CLUSTER INFO
            // is often allowed, and fails on a server without cluster mode.
            Err(e) if e.code() == Some("NOPERM") => {
                match redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut conn) {
                    Ok(info) => info.contains("cluster_state"),
                    Err(e) if crate::error::redis_is_outage(&e) => {
                        return Err(crate::connect::redis_unreachable(url, e))
                    }
                    Err(e) if e.code() == Some("NOPERM") => {
                        log::warn!(
                            "redis: INFO and CLUSTER INFO refused to this user, so taskhub \
                             assumes one server; for a Redis Cluster give several node URLs \
                             separated by commas"
                        );
                        false
                    }
                    // "This instance has cluster support disabled".
                    Err(_) => false,
                }
            }
            Err(e) => return Err(crate::connect::redis_unreachable(url, e)),
        };
        if !cluster {
            return Ok(RedisClient::Single(client));
        }
        // Every node known now is a seed too: a new connection (after a
        // failure, say) must not depend on the one node named in the URL.
        let mut seeds = vec![first.to_owned()];
        if let Ok(nodes) = redis::cmd("CLUSTER")
            .arg("NODES")
            .query::<String>(&mut conn)
        {
            seeds.extend(node_addresses(&nodes).map(|addr| with_address(first, &addr)));
        }
        let mut seen = std::collections::HashSet::new();
        seeds.retain(|seed| seen.insert(seed.clone()));
        let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
        cluster_client(url, &seeds, tls)
    }

    /// A new connection whose commands time out after `read_timeout`.
    pub fn connect(&self, read_timeout: Duration) -> RedisResult<RedisConn> {
        let conn = match self {
            RedisClient::Single(client) => {
                let conn = client.get_connection_with_timeout(CONNECT_TIMEOUT)?;
                conn.set_write_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                RedisConn::Single(conn)
            }
            RedisClient::Cluster(client) => {
                let conn = client.get_connection()?;
                conn.set_write_timeout(Some(REDIS_COMMAND_TIMEOUT))?;
                RedisConn::Cluster {
                    conn: Box::new(conn),
                    stale: false,
                }
            }
        };
        conn.set_read_timeout(read_timeout)?;
        Ok(conn)
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self, RedisClient::Cluster(_))
    }
}

/// The `host:port` of every healthy node in a `CLUSTER NODES` reply.
fn node_addresses(nodes: &str) -> impl Iterator<Item = String> + '_ {
    nodes.lines().filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (addr, flags) = (fields.get(1)?, fields.get(2)?);
        if flags.contains("fail") || flags.contains("noaddr") || flags.contains("handshake") {
            return None;
        }
        // ip:port@cport[,hostname]
        let addr = addr.split(['@', ',']).next()?;
        (!addr.starts_with(':')).then(|| addr.to_owned())
    })
}

/// `url` with its `host:port` replaced by `addr` (scheme, user, password and
/// database kept).
fn with_address(url: &str, addr: &str) -> String {
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let end = url[start..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| start + i);
    let host_start = url[start..end].rfind('@').map_or(start, |i| start + i + 1);
    let addr = match addr.rsplit_once(':') {
        // An IPv6 address goes in brackets.
        Some((host, port)) if host.contains(':') && !host.starts_with('[') => {
            format!("[{host}]:{port}")
        }
        _ => addr.to_owned(),
    };
    format!("{}{addr}{}", &url[..host_start], &url[end..])
}

/// One connection to `url` (one server or a cluster), for the CLI and the
/// library's helpers; fails with the cause when Redis cannot be reached.
pub(crate) fn connect(url: &str, tls: &Tls) -> Result<RedisConn, Error> {
    RedisClient::open(url, tls)?
        .connect(REDIS_COMMAND_TIMEOUT)
        .map_err(|e| crate::connect::redis_unreachable(url, e))
}

fn cluster_client(url: &str, nodes: &[&str], tls: &Tls) -> Result<RedisClient, Error> {
    let bad = |e: redis::RedisError| {
        Error::with_source(
            ErrorKind::Config,
            format!("bad Redis Cluster URL {:?}", redact(url)),
            e,
        )
    };
    let mut builder = ClusterClient::builder(nodes.to_vec())
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(REDIS_COMMAND_TIMEOUT)
        // Enough to follow a redirection or two; our own loops wait out
        // longer outages and keep an eye on the shutdown meanwhile.
        .retries(3)
        .min_retry_wait(50)
        .max_retry_wait(1_000);
    // The TLS mode (and #insecure) comes from the first node's URL; the CA
    // file and the client certificate from `tls`, for every node.
    if nodes.first().is_some_and(|n| is_tls_url(n)) {
        if let Some(certificates) = crate::tls::redis_certificates(tls)? {
            builder = builder.certs(certificates);
        }
    }
    let client = builder.build().map_err(bad)?;
    // Connect once, so that a wrong address fails now with its cause.
    let mut conn = client
        .get_connection()
        .map_err(|e| crate::connect::redis_unreachable(url, e))?;
    redis::cmd("PING")
        .query::<()>(&mut conn)
        .map_err(|e| crate::connect::redis_unreachable(url, e))?;
    log::debug!("redis: cluster mode, {} seed nodes", nodes.len());
    Ok(RedisClient::Cluster(client))
}

/// Checks that each stream shares its hash slot with its dead-letter stream,
/// as a cluster needs (see the module's documentation). Harmless on a
/// single server, where every key is on the one node.
pub(crate) fn check_slots(streams: &[String]) -> Result<(), Error> {
    use redis::cluster_routing::Slot;
    for stream in streams {
        let dlq = crate::dead_letter::dead_letter_stream(stream);
        if Slot::for_key(stream) != Slot::for_key(&dlq) {
            return Err(Error::new(
                ErrorKind::Config,
                format!(
                    "stream {stream:?} and its dead-letter stream {dlq:?} are in different \
                     hash slots of the Redis Cluster; name the stream with a hash tag, \
                     such as \"{{{stream}}}\", so both land on one node"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_slots, node_addresses, with_address};

    #[test]
    fn seeds_keep_everything_but_the_address() {
        assert_eq!(
            with_address("rediss://u:p@redis-a:7000/0", "10.0.0.2:7001"),
            "rediss://u:p@10.0.0.2:7001/0"
        );
        assert_eq!(
            with_address("redis://127.0.0.1:7000", "::1:7002"),
            "redis://[::1]:7002"
        );
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7001@17001,host-b master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7002@17002 master,fail - 0 0 3 disconnected
d4 :0@0 slave,noaddr - 0 0 0 disconnected
";
        let found: Vec<String> = node_addresses(nodes).collect();
        assert_eq!(found, ["127.0.0.1:7000", "127.0.0.1:7001"]);
    }

    #[test]
    fn streams_need_a_hash_tag_on_a_cluster() {
        assert!(check_slots(&["{orders}".into(), "{app}:events".into()]).is_ok());
        let err = check_slots(&["orders".into()]).unwrap_err().to_string();
        assert!(err.contains("\"{orders}\""), "{err}");
        // An empty tag is no tag: the whole name is hashed.
        assert!(check_slots(&["{}orders".into()]).is_err());
    }
}
