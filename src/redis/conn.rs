//! [`RedisConn`]: one connection to a Redis server or to a Redis Cluster,
//! and [`Pipe`], a pipeline that works on both.

use std::time::Duration;

use redis::cluster::{ClusterConnection, ClusterPipeline};
use redis::{Cmd, ConnectionLike, FromRedisValue, RedisResult, ToRedisArgs, Value};

use crate::error::Error;
use crate::redis::check_slots;

/// A connection to one Redis server or to a Redis Cluster.
pub enum RedisConn {
    /// One server (`redis://` or `rediss://`).
    Single {
        /// The connection.
        conn: redis::Connection,
        /// Set when a reply was found out of place (see
        /// [`RedisConn::mark_stale`]): the pool drops this connection.
        stale: bool,
    },
    /// A cluster: connections to the nodes, opened as they are needed.
    Cluster {
        /// redis-rs' cluster connection, with its map of the slots.
        conn: Box<ClusterConnection>,
        /// Set when a pipeline failed (see [`Pipe::query`]) or a reply was
        /// found out of place: the pool drops this connection and the next
        /// one starts afresh.
        stale: bool,
    },
}

impl RedisConn {
    /// An empty pipeline of the right kind for this connection.
    pub fn pipe(&self) -> Pipe {
        match self {
            RedisConn::Single { .. } => Pipe {
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

    /// Whether the pool should drop this connection: closed, or marked
    /// stale.
    pub(crate) fn is_broken(&self) -> bool {
        match self {
            RedisConn::Single { conn, stale } => *stale || !conn.is_open(),
            RedisConn::Cluster { conn, stale } => *stale || !conn.is_open(),
        }
    }

    /// Marks this connection as one whose replies can no longer be matched
    /// to its commands (a reply of the wrong type, or a wrong count, was
    /// found where a known one was due): the pool drops it instead of
    /// handing it to the next user, who would read the leftover replies as
    /// its own.
    pub(crate) fn mark_stale(&mut self) {
        match self {
            RedisConn::Single { stale, .. } | RedisConn::Cluster { stale, .. } => *stale = true,
        }
    }

    pub(crate) fn set_read_timeout(&self, timeout: Duration) -> RedisResult<()> {
        match self {
            RedisConn::Single { conn: c, .. } => c.set_read_timeout(Some(timeout)),
            RedisConn::Cluster { conn: c, .. } => c.set_read_timeout(Some(timeout)),
        }
    }
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RedisConn::Single { .. } => "RedisConn::Single",
            RedisConn::Cluster { .. } => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        match self {
            RedisConn::Single { conn: c, stale } => {
                lost_if_interrupted(c.req_packed_command(cmd), stale)
            }
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
            RedisConn::Single { conn: c, stale } => {
                lost_if_interrupted(c.req_packed_commands(cmd, offset, count), stale)
            }
            // A MULTI/EXEC block goes to the node of its first key.
            RedisConn::Cluster { conn, stale } => {
                lost_if_cut(conn.req_packed_commands(cmd, offset, count), stale)
            }
        }
    }

    fn req_command(&mut self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            RedisConn::Single { conn: c, stale } => lost_if_interrupted(c.req_command(cmd), stale),
            RedisConn::Cluster { conn, stale } => lost_if_cut(conn.req_command(cmd), stale),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            RedisConn::Single { conn: c, .. } => c.get_db(),
            RedisConn::Cluster { conn: c, .. } => c.get_db(),
        }
    }

    fn check_connection(&mut self) -> bool {
        match self {
            RedisConn::Single { conn: c, .. } => c.check_connection(),
            RedisConn::Cluster { conn: c, .. } => c.check_connection(),
        }
    }

    fn is_open(&self) -> bool {
        match self {
            RedisConn::Single { conn: c, .. } => c.is_open(),
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
                // (seen in tests/it/cluster.rs: markers read as present after a
                // node restart, so events skipped as duplicates): after such
                // a failure the connection is dropped.
                result => lost_unless_all_read(result, stale),
            },
            (Inner::Cluster(_), RedisConn::Single { .. }) => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a cluster pipeline sent on a single-server connection",
            ))),
        }
    }
}

/// Marks a connection to one server `stale` when a signal interrupted its
/// exchange (EINTR: a stop and continue of the process): its reply may be
/// left unread, and redis-rs keeps the connection open after it.
fn lost_if_interrupted<T>(result: RedisResult<T>, stale: &mut bool) -> RedisResult<T> {
    if let Err(e) = &result {
        if crate::net::interrupted(&e.to_string()) {
            *stale = true;
        }
    }
    result
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

/// Marks a cluster connection `stale` after a failed pipeline unless the
/// failure proves that every reply was read: errors of two commands or
/// more, which redis-rs only reports once it has all the replies. One error
/// reply is not proof: it may come from a node connection opened halfway
/// through the sends (redis-rs opens it with a `PING`, which a node still
/// loading its data answers with `LOADING`), after other nodes' commands
/// went out and before their replies were read. A pipeline with one failed
/// command then costs a new connection; a wrong guess the other way would
/// hand the next user replies that are not its own.
fn lost_unless_all_read<T>(result: RedisResult<T>, stale: &mut bool) -> RedisResult<T> {
    if let Err(e) = &result {
        let all_read = e
            .clone()
            .into_server_errors()
            .is_some_and(|errors| errors.len() >= 2);
        if !all_read {
            *stale = true;
        }
    }
    result
}

/// Whether `e` is an error reply from the server, not a broken exchange: for
/// one command (every reply was read), not for a cluster pipeline (see
/// [`lost_unless_all_read`]).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interrupted_exchange_leaves_its_connection_stale() {
        let io = |code| {
            Err::<(), _>(redis::RedisError::from(std::io::Error::from_raw_os_error(
                code,
            )))
        };
        let mut stale = false;
        let _ = lost_if_interrupted(io(libc::EINTR), &mut stale);
        assert!(stale);
        let mut stale = false;
        let _ = lost_if_interrupted(io(libc::ECONNREFUSED), &mut stale);
        let _ = lost_if_interrupted(Ok(()), &mut stale);
        assert!(!stale);
    }

    /// A connection that answers every pipeline with `replies`.
    struct Canned(Vec<Value>);

    impl ConnectionLike for Canned {
        fn req_packed_command(&mut self, _: &[u8]) -> RedisResult<Value> {
            Ok(self.0[0].clone())
        }
        fn req_packed_commands(&mut self, _: &[u8], _: usize, _: usize) -> RedisResult<Vec<Value>> {
            Ok(self.0.clone())
        }
        fn get_db(&self) -> i64 {
            0
        }
        fn check_connection(&mut self) -> bool {
            true
        }
        fn is_open(&self) -> bool {
            true
        }
    }

    fn error_reply(text: &str) -> Value {
        redis::parse_redis_value(format!("-{text}\r\n").as_bytes()).unwrap()
    }

    /// The error of a pipeline of two `GET`s answered with `replies`, as
    /// redis-rs builds it once it has read them all.
    fn pipeline_error(replies: Vec<Value>) -> redis::RedisError {
        redis::pipe()
            .cmd("GET")
            .arg("a")
            .cmd("GET")
            .arg("b")
            .query::<Vec<Value>>(&mut Canned(replies))
            .unwrap_err()
    }

    fn stale_after(e: redis::RedisError) -> bool {
        let mut stale = false;
        let _ = lost_unless_all_read::<()>(Err(e), &mut stale);
        stale
    }

    #[test]
    fn only_a_pipeline_error_of_several_commands_keeps_a_cluster_connection() {
        let two = pipeline_error(vec![error_reply("OOM no"), error_reply("OOM no")]);
        assert!(!stale_after(two));
        // One failed command looks like an error met while connecting to a
        // node mid-send: the connection goes.
        let one = pipeline_error(vec![error_reply("OOM no"), Value::Nil]);
        assert!(stale_after(one));
        let loading = error_reply("LOADING Redis is loading the dataset in memory")
            .extract_error()
            .unwrap_err();
        assert!(stale_after(loading));
        let cut =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(stale_after(cut));
        let mut stale = false;
        assert!(lost_unless_all_read(Ok(()), &mut stale).is_ok());
        assert!(!stale);
    }
}
