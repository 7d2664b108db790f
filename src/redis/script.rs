//! The Lua scripts of the hot path, called by their SHA1 digest
//! (`EVALSHA`): a read or an ack sends 40 bytes for its script, not the
//! script (about 3 KB for the read), and neither we nor Redis hash or copy
//! its text on every call.
//!
//! A server that does not have the script (restarted, `SCRIPT FLUSH`,
//! another node of a cluster) answers `NOSCRIPT`; the call is then sent
//! once more as `EVAL` with the script's text, which runs it and caches it
//! on that server. `EVAL` routes by the same keys as `EVALSHA`, so on a
//! cluster it reaches the node that refused.

use redis::{FromRedisValue, RedisResult};

use crate::redis::RedisConn;

/// A Lua script and its SHA1 digest.
pub(crate) struct Script {
    text: String,
    sha: String,
}

impl Script {
    pub(crate) fn new(text: String) -> Script {
        let sha = redis::Script::new(&text).get_hash().to_owned();
        Script { text, sha }
    }

    /// `EVALSHA <digest>`: the caller adds the number of keys, the keys and
    /// the arguments, then runs it with [`Script::query`].
    pub(crate) fn cmd(&self) -> redis::Cmd {
        self.cmd_with_capacity(0, 0)
    }

    /// [`Script::cmd`] with room for `args` more arguments of `bytes` in
    /// all: a call of many arguments (an ack's markers and ids) then
    /// builds without growing its buffers.
    pub(crate) fn cmd_with_capacity(&self, args: usize, bytes: usize) -> redis::Cmd {
        let mut cmd = redis::Cmd::with_capacity(args + 2, bytes + "EVALSHA".len() + self.sha.len());
        cmd.arg("EVALSHA").arg(&self.sha);
        cmd
    }

    /// Runs `cmd` (made by [`Script::cmd`]); where the server does not have
    /// the script, sends it again as `EVAL` with the script's text.
    pub(crate) fn query<T: FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        conn: &mut RedisConn,
    ) -> RedisResult<T> {
        match cmd.query(conn) {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                let mut eval = redis::cmd("EVAL");
                eval.arg(&self.text);
                for arg in cmd.args_iter().skip(2) {
                    let redis::Arg::Simple(arg) = arg else {
                        unreachable!("a script call has no cursor argument")
                    };
                    eval.arg(arg);
                }
                eval.query(conn)
            }
            reply => reply,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script no server has seen: the EVALSHA is refused, the EVAL that
    /// follows runs it with its keys and arguments and caches it, and the
    /// next call goes by digest.
    #[test]
    fn a_script_the_server_lacks_is_sent_once_with_its_text() {
        let mut conn = crate::redis::streams::tests::conn();
        let unique = uuid::Uuid::new_v4().simple().to_string();
        let script = Script::new(format!("-- {unique}\nreturn {{KEYS[1], ARGV[1], ARGV[2]}}"));
        let cached = |conn: &mut RedisConn| -> Vec<bool> {
            redis::cmd("SCRIPT")
                .arg("EXISTS")
                .arg(&script.sha)
                .query(conn)
                .unwrap()
        };
        assert_eq!(cached(&mut conn), [false]);
        let mut cmd = script.cmd();
        cmd.arg(1).arg("k").arg("a").arg(b"\x00\xff".as_slice());
        let reply: Vec<Vec<u8>> = script.query(&cmd, &mut conn).unwrap();
        assert_eq!(reply, [b"k".to_vec(), b"a".to_vec(), b"\x00\xff".to_vec()]);
        assert_eq!(cached(&mut conn), [true]);
        let again: Vec<Vec<u8>> = script.query(&cmd, &mut conn).unwrap();
        assert_eq!(again, reply);
    }

    /// Other errors are the script's own, not sent again.
    #[test]
    fn a_script_error_is_returned_as_it_is() {
        let mut conn = crate::redis::streams::tests::conn();
        let script = Script::new("return redis.error_reply('BROKEN on purpose')".into());
        let mut cmd = script.cmd();
        cmd.arg(0);
        let err = script.query::<()>(&cmd, &mut conn).unwrap_err();
        assert_eq!(err.code(), Some("BROKEN"), "{err}");
    }
}
