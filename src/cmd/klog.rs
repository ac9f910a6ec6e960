//! klog's text line format for tracing events, for log shippers and log-based alerts
//! that parse upstream's lines: `I1127 15:04:05.000000    1234 file.rs:42] "msg" k="v"`.

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// Formats each event as klog's structured text output does (`klog.InfoS`): a header
/// with severity letter, UTC date and time to the microsecond, process id and source
/// `file:line`, then the quoted message and `key=value` pairs (strings quoted as Go's
/// `%q` quotes them), the enclosing spans' fields last.
pub struct Klog {
    /// Keep the source file's directory (`--add-dir-header`).
    pub dir_header: bool,
    /// No header at all (`--skip-headers`).
    pub skip_headers: bool,
}

impl<S, N> FormatEvent<S, N> for Klog
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        if !self.skip_headers {
            let now = time::OffsetDateTime::now_utc();
            let file = meta.file().unwrap_or("???");
            let file = if self.dir_header {
                file
            } else {
                file.rsplit('/').next().unwrap_or(file)
            };
            write!(
                writer,
                "{}{:02}{:02} {:02}:{:02}:{:02}.{:06} {:>7} {}:{}] ",
                severity_letter(*meta.level()),
                u8::from(now.month()),
                now.day(),
                now.hour(),
                now.minute(),
                now.second(),
                now.microsecond(),
                std::process::id(),
                file,
                meta.line().unwrap_or(0),
            )?;
        }
        let mut fields = KlogFields::default();
        event.record(&mut fields);
        writer.write_str(&go_quote(&fields.message))?;
        writer.write_str(&fields.pairs)?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                if let Some(formatted) = ext.get::<FormattedFields<N>>() {
                    if !formatted.is_empty() {
                        write!(writer, " {formatted}")?;
                    }
                }
            }
        }
        writeln!(writer)
    }
}

/// Formats the spans' fields as klog formats an event's pairs (`key="value"`, strings
/// quoted), so a peer's text in a span cannot forge a key or a line either.
pub struct KlogSpanFields;

impl<'writer> tracing_subscriber::fmt::FormatFields<'writer> for KlogSpanFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut visitor = KlogFields::default();
        fields.record(&mut visitor);
        if !visitor.message.is_empty() {
            write!(writer, "msg={} ", go_quote(&visitor.message))?;
        }
        writer.write_str(visitor.pairs.trim_start())
    }
}

/// The `text` format's fields: `key=value` as tracing writes them, but a value that is
/// not one bare token (a space, `=`, a quote, a control character) is quoted as klog
/// quotes it, and the message has its control characters escaped. An agent ID of
/// `nodeB peer=10.9.9.9:4242` then stays one value instead of forging a `peer` field,
/// and no value can end the line.
pub struct TextFields;

impl<'writer> tracing_subscriber::fmt::FormatFields<'writer> for TextFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: Writer<'writer>,
        fields: R,
    ) -> fmt::Result {
        let mut visitor = TextVisitor::default();
        fields.record(&mut visitor);
        let mut out = visitor.message;
        if !visitor.pairs.is_empty() {
            if !out.is_empty() {
                out.push(' ');
            }
            out.push_str(visitor.pairs.trim_start());
        }
        writer.write_str(&out)
    }
}

#[derive(Default)]
struct TextVisitor {
    message: String,
    pairs: String,
}

impl TextVisitor {
    /// `key=text`, quoted unless `text` is one bare token (no space, `=`, quote,
    /// backslash or control character).
    fn pair(&mut self, field: &Field, text: &str) {
        let bare = !text.is_empty()
            && !text
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '=' | '"' | '\\'));
        if bare {
            let _ = write!(self.pairs, " {}={}", key(field), text);
        } else {
            let _ = write!(self.pairs, " {}={}", key(field), go_quote(text));
        }
    }
}

impl Visit for TextVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = escape_controls(value);
        } else {
            let _ = write!(self.pairs, " {}={}", key(field), go_quote(value));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.pair(field, &value.to_string());
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let text = format!("{value:?}");
        if field.name() == "message" {
            self.message = escape_controls(&text);
        } else {
            self.pair(field, &text);
        }
    }
}

/// `s` with control characters escaped as Go escapes them, and nothing else changed.
fn escape_controls(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// klog's severity letters; tracing's DEBUG and TRACE are klog's `V(n)` lines, which
/// klog writes as `I`.
fn severity_letter(level: Level) -> char {
    match level {
        Level::ERROR => 'E',
        Level::WARN => 'W',
        _ => 'I',
    }
}

#[derive(Default)]
struct KlogFields {
    message: String,
    pairs: String,
}

impl Visit for KlogFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            let _ = write!(self.pairs, " {}={}", key(field), go_quote(value));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let _ = write!(
            self.pairs,
            " {}={}",
            key(field),
            go_quote(&value.to_string())
        );
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if field.name() == "message" {
            self.message = format!("{value:?}");
        } else {
            let text = format!("{value:?}");
            // Numbers and booleans stay bare; anything else, peers' text included, is
            // quoted here, so no value can end the line or forge a key. (Even text that
            // looks quoted: a peer's `"node-b"` must not read as node-b's own ID.)
            let bare = !text.is_empty()
                && (text.parse::<f64>().is_ok() || text == "true" || text == "false");
            if bare {
                let _ = write!(self.pairs, " {}={}", key(field), text);
            } else {
                let _ = write!(self.pairs, " {}={}", key(field), go_quote(&text));
            }
        }
    }
}

/// tracing spells `r#type` fields with the raw prefix; klog keys have none.
fn key(field: &Field) -> &str {
    field.name().trim_start_matches("r#")
}

/// A string as Go's `strconv.Quote` writes it (the escapes klog's text output uses).
fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// What `log` writes through a klog layer.
    fn logged(log: impl FnOnce()) -> String {
        let buf = Buf::default();
        let sink = buf.clone();
        let subscriber = tracing_subscriber::registry().with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .fmt_fields(KlogSpanFields)
                .event_format(Klog {
                    dir_header: false,
                    skip_headers: false,
                })
                .with_writer(move || sink.clone()),
        );
        tracing::subscriber::with_default(subscriber, log);
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        text
    }

    #[test]
    fn lines_parse_as_klog_lines() {
        let text = logged(|| {
            let span = tracing::info_span!("agent", agent_id = "a-1");
            let _g = span.enter();
            tracing::warn!(count = 3, addr = %"10.0.0.1:10250", "dial \"failed\"");
        });
        let line = text.lines().next().unwrap();
        // Lmmdd hh:mm:ss.uuuuuu threadid file:line] msg
        let re = regex_lite(line);
        assert!(re, "{line}");
        assert!(line.contains("klog.rs:"), "{line}");
        assert!(
            line.ends_with(r#"] "dial \"failed\"" count=3 addr="10.0.0.1:10250" agent_id="a-1""#),
            "{line}"
        );
    }

    /// `W1127 15:04:05.123456    1234 ` by hand (no regex dependency).
    fn regex_lite(line: &str) -> bool {
        let b = line.as_bytes();
        b.len() > 30
            && b[0] == b'W'
            && b[1..5].iter().all(u8::is_ascii_digit)
            && b[5] == b' '
            && b[8] == b':'
            && b[11] == b':'
            && b[14] == b'.'
            && b[15..21].iter().all(u8::is_ascii_digit)
            && b[21] == b' '
            && line[22..29].trim_start().parse::<u32>().is_ok()
            && b[29] == b' '
    }

    #[test]
    fn a_peer_cannot_forge_a_line_or_a_key() {
        let evil = "\"x\" forged=\"yes\"\nE1127 00:00:00.000000 1 fake.go:1] \"owned\"";
        let text = logged(|| {
            let span = tracing::info_span!("agent", id = %evil);
            let _g = span.enter();
            tracing::info!(error = %evil, debug = ?evil, "dial failed");
        });
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(!text.contains(" forged=\"yes\""), "{text}");
        // Text that looks quoted is quoted again: a peer's `"node-b"` is not node-b.
        let text = logged(|| {
            let id = "\"node-b\"";
            tracing::info!(agent_id = %id, "agent connected");
        });
        assert!(text.contains(r#"agent_id="\"node-b\"""#), "{text}");
    }

    #[test]
    fn quoting_is_gos() {
        assert_eq!(go_quote("a\"b\\c\n\u{1}"), r#""a\"b\\c\n\x01""#);
    }
}
