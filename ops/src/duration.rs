//! Go-style durations (`1h`, `30s`, `1m30s`, `500ms`, `0`), as upstream flags take them.

use std::time::Duration;

/// Parses a Go `time.ParseDuration` string (without sign; negatives are refused).
pub fn parse(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    if s.is_empty() {
        return Err("empty duration (use e.g. 30s, 5m, 1h)".into());
    }
    let mut total = 0f64;
    let mut rest = s;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| format!("duration {s:?} lacks a unit (use ns, us, ms, s, m or h)"))?;
        if num_len == 0 {
            return Err(format!("invalid duration {s:?} (use e.g. 30s, 5m, 1h)"));
        }
        let value: f64 = rest[..num_len]
            .parse()
            .map_err(|_| format!("invalid number in duration {s:?}"))?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            other => {
                return Err(format!(
                    "unknown unit {other:?} in duration {s:?} (use ns, us, ms, s, m or h)"
                ))
            }
        };
        total += value * scale;
        rest = &rest[unit_len..];
    }
    Ok(Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_go_durations() {
        assert_eq!(parse("0").unwrap(), Duration::ZERO);
        assert_eq!(parse("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(parse("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse("1.5s").unwrap(), Duration::from_millis(1500));
        assert!(parse("10").is_err());
        assert!(parse("5x").is_err());
        assert!(parse("").is_err());
        assert!(parse("-1s").is_err());
    }
}
