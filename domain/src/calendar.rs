//! UTC calendar arithmetic on Unix milliseconds: where hours, days, ISO
//! weeks (from Monday) and months begin, for usage rollups and budgets.
//! Proleptic Gregorian, no leap seconds, as PostgreSQL's `timestamptz`.

/// Milliseconds in an hour, a day and a week.
pub const HOUR_MS: i64 = 3_600_000;
pub const DAY_MS: i64 = 24 * HOUR_MS;
pub const WEEK_MS: i64 = 7 * DAY_MS;

/// Days since 1970-01-01 of a date.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day since 1970-01-01: (year, month, day).
pub fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    (y, m, d)
}

/// The start of the day holding `ms`.
pub fn day_start(ms: i64) -> i64 {
    ms.div_euclid(DAY_MS) * DAY_MS
}

/// The start of the ISO week (Monday 00:00) holding `ms`.
pub fn week_start(ms: i64) -> i64 {
    // 1970-01-01 was a Thursday: three days after a Monday.
    let days = ms.div_euclid(DAY_MS);
    (days - (days + 3).rem_euclid(7)) * DAY_MS
}

/// The start of the month holding `ms`.
pub fn month_start(ms: i64) -> i64 {
    let (y, m, _) = civil(ms.div_euclid(DAY_MS));
    days_from_civil(y, m, 1) * DAY_MS
}

/// The start of the month after the one starting at `start`.
pub fn next_month(start: i64) -> i64 {
    let (y, m, _) = civil(start.div_euclid(DAY_MS));
    let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
    days_from_civil(y, m, 1) * DAY_MS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn periods_begin_where_the_calendar_says() {
        // 2026-12-03T15:04:05Z, a Thursday.
        let t = days_from_civil(2026, 12, 3) * DAY_MS + 15 * HOUR_MS + 245_000;
        assert_eq!(civil(t.div_euclid(DAY_MS)), (2026, 12, 3));
        assert_eq!(day_start(t), days_from_civil(2026, 12, 3) * DAY_MS);
        assert_eq!(week_start(t), days_from_civil(2026, 11, 30) * DAY_MS);
        assert_eq!(
            week_start(days_from_civil(2026, 11, 30) * DAY_MS),
            days_from_civil(2026, 11, 30) * DAY_MS
        );
        assert_eq!(month_start(t), days_from_civil(2026, 12, 1) * DAY_MS);
        assert_eq!(
            next_month(month_start(t)),
            days_from_civil(2027, 1, 1) * DAY_MS
        );
        assert_eq!(week_start(0), -3 * DAY_MS);
        for days in [-800_000, -1, 0, 1, 59, 365 * 30 + 7, 2_000_000] {
            let (y, m, d) = civil(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }
}
