//! The run's token: every call to a worker carries it, and a worker refuses calls without it.
//!
//! The orchestrator makes a fresh random token per run and hands it to its workers in a file
//! (`--token-file`), never on a command line where `ps` would show it. Tokens are compared in
//! constant time.

use std::path::Path;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// A run's shared secret.
#[derive(Clone)]
pub struct Token(String);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// Why a token file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the token file {path} is empty: it must hold the run's token on one line")]
    Empty { path: String },
    #[error("cannot write the token file {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl Token {
    /// A new random token (256 bits, hex).
    pub fn generate() -> Token {
        let bytes: [u8; 32] = rand::random();
        Token(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Read a token from a file (surrounding whitespace ignored).
    pub fn read(path: &Path) -> Result<Token, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let token = text.trim();
        if token.is_empty() {
            return Err(TokenError::Empty {
                path: path.display().to_string(),
            });
        }
        Ok(Token(token.to_string()))
    }

    /// Write the token to a file readable only by its owner.
    pub fn write(&self, path: &Path) -> Result<(), TokenError> {
        let err = |source| TokenError::Write {
            path: path.display().to_string(),
            source,
        };
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(path).map_err(err)?;
        std::io::Write::write_all(&mut file, self.0.as_bytes()).map_err(err)
    }

    /// Constant-time comparison with what a caller presented.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = self.0.as_bytes();
        // Length is not secret (every token has the same length); contents are.
        if presented.len() != expected.len() {
            return false;
        }
        expected
            .iter()
            .zip(presented)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }

    /// A server interceptor that refuses calls without `authorization: Bearer <token>`.
    pub fn interceptor(&self) -> Check {
        Check(self.clone())
    }

    /// A client interceptor that adds the token to every call.
    pub fn attach(&self) -> Attach {
        Attach(
            format!("Bearer {}", self.0)
                .parse()
                .expect("hex tokens are valid metadata"),
        )
    }
}

/// Server side: refuses calls that do not carry the run's token.
#[derive(Clone)]
pub struct Check(Token);

impl Interceptor for Check {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        match presented {
            Some(p) if self.0.matches(p) => Ok(request),
            Some(_) => Err(Status::unauthenticated(
                "wrong token: this worker belongs to another run",
            )),
            None => Err(Status::unauthenticated(
                "missing token: call with `authorization: Bearer <the run's token>`",
            )),
        }
    }
}

/// Client side: adds the run's token to every call.
#[derive(Clone)]
pub struct Attach(MetadataValue<Ascii>);

impl Interceptor for Attach {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert("authorization", self.0.clone());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_by_content() {
        let t = Token("abcd".into());
        assert!(t.matches(b"abcd"));
        assert!(!t.matches(b"abce"));
        assert!(!t.matches(b"abc"));
        assert!(!t.matches(b""));
    }

    #[test]
    fn generated_tokens_differ_and_round_trip_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = Token::generate();
        assert!(!a.matches(Token::generate().0.as_bytes()));
        let path = dir.path().join("token");
        a.write(&path).unwrap();
        assert!(Token::read(&path).unwrap().matches(a.0.as_bytes()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(
                std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
        std::fs::write(&path, "\n").unwrap();
        assert!(Token::read(&path).unwrap_err().to_string().contains("is empty"));
    }

    #[test]
    fn interceptor_refuses_missing_and_wrong_tokens() {
        let t = Token::generate();
        let mut check = t.interceptor();
        let e = check.call(Request::new(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        assert!(e.message().starts_with("missing token"));
        let e = Token::generate()
            .attach()
            .call(Request::new(()))
            .and_then(|r| check.call(r))
            .unwrap_err();
        assert!(e.message().starts_with("wrong token"));
        assert!(t
            .attach()
            .call(Request::new(()))
            .and_then(|r| check.call(r))
            .is_ok());
    }
}
