//! The one way errors are printed, at start-up and in logs: the error's message, then
//! each cause in its `source()` chain, joined by ": ". Tether's own error types name
//! their cause either in the message or as `source()`, never both; a cause whose text
//! the line already holds is skipped, for the foreign types that do both (kube's
//! `ApiError: {0}` among them).

use std::error::Error;
use std::fmt;

/// Displays an error with its causes: `outer: middle: inner`.
pub struct Chain<'a>(&'a (dyn Error + 'a));

/// `e` with its causes, for `error = %chain(&e)` in a log event or a start-up line.
pub fn chain<'a>(e: &'a (dyn Error + 'a)) -> Chain<'a> {
    Chain(e)
}

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read {0}")]
    struct Read(&'static str, #[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("start-up failed")]
    struct Outer(#[source] Read);

    #[test]
    fn every_cause_once_in_order() {
        let e = Outer(Read(
            "ca.crt",
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        ));
        assert_eq!(
            chain(&e).to_string(),
            "start-up failed: cannot read ca.crt: no such file"
        );
    }

    #[test]
    fn a_cause_the_message_already_holds_is_not_repeated() {
        #[derive(Debug, thiserror::Error)]
        #[error("ApiError: {0}")]
        struct Both(#[source] std::io::Error);
        let e = Both(std::io::Error::other("forbidden"));
        assert_eq!(chain(&e).to_string(), "ApiError: forbidden");
    }
}
