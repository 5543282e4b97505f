# Sourced by the .ci/fetch-* scripts: fetch one package from Debian sid into a cache directory,
# the system's packages and apt state untouched. apt runs with a private source list (the
# machine's Debian mirror, suite sid), a private lists and cache directory and an empty dpkg
# status, downloads the .deb, and dpkg-deb -x unpacks it under CACHE/root. A binary already there
# that passes the caller's check is reused, no download; another fetch of the same cache running
# at once is waited for. Progress goes to stderr; the binary's path, on success, to stdout.
#
#   fetch_sid_package LABEL CACHE PACKAGE BINARY CHECK
#
# LABEL prefixes the messages, BINARY is the path inside the package (usr/bin/prometheus), CHECK
# a command (a shell function) given the unpacked binary's path that succeeds only if it is the
# build wanted: a package that unpacks one that fails it fails the fetch.

SID_KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
SID_FALLBACK_MIRROR=http://deb.debian.org/debian

# The URI of the Debian entry that has the bookworm suite: deb822 first, then one-line format.
_sid_mirror_deb822() {
    [ -r "$1" ] || return 0
    awk 'BEGIN { RS = ""; FS = "\n" }
    {
        types = ""; uris = ""; suites = ""; enabled = "yes"
        for (i = 1; i <= NF; i++) {
            line = $i
            if (line ~ /^[ \t]*#/) continue
            key = tolower(line); sub(/:.*/, "", key)
            value = line; sub(/^[^:]*:[ \t]*/, "", value)
            if (key == "types") types = " " value " "
            else if (key == "uris") uris = value
            else if (key == "suites") suites = " " value " "
            else if (key == "enabled") enabled = tolower(value)
        }
        if (types ~ / deb / && suites ~ /[ \t]bookworm[ \t]/ && enabled != "no" && uris != "") {
            split(uris, u, /[ \t]+/); print u[1]; exit
        }
    }' "$1"
}
_sid_mirror_one_line() {
    [ -r "$1" ] || return 0
    awk '{ sub(/#.*/, ""); gsub(/\[[^]]*\]/, "") }
    $1 == "deb" && $3 == "bookworm" { print $2; exit }' "$1"
}

fetch_sid_package() {
    local label=$1 cache=$2 package=$3 binary=$4 check=$5
    local bin=$cache/root/$binary

    mkdir -p "$cache"
    exec 9>"$cache/.lock"
    flock 9  # another run on this machine fetching right now: wait for it, then reuse its binary
    if "$check" "$bin"; then
        echo "$label: cached in $cache" >&2
        echo "$bin"
        return 0
    fi

    local mirror
    mirror=$(_sid_mirror_deb822 /etc/apt/sources.list.d/debian.sources)
    [ -n "$mirror" ] || mirror=$(_sid_mirror_one_line /etc/apt/sources.list)
    case "$mirror" in
        http://* | https://*) mirror=${mirror%/} ;;
        *) mirror=$SID_FALLBACK_MIRROR ;;  # none found, or a scheme (cdrom:, file:) without sid
    esac
    echo "$label: fetching $package from $mirror sid" >&2

    local state=$cache/apt
    mkdir -p "$state/lists/partial" "$state/cache/archives/partial" "$state/preferences.d"
    printf 'deb [signed-by=%s] %s sid main\n' "$SID_KEYRING" "$mirror" >"$state/sources.list"
    : >"$state/status"  # no installed packages: the only candidate is sid's
    local apt_opts=(
        -o "Dir::Etc::sourcelist=$state/sources.list"
        -o "Dir::Etc::sourceparts=-"
        -o "Dir::Etc::preferences=$state/preferences"
        -o "Dir::Etc::preferencesparts=$state/preferences.d"
        -o "Dir::State::Lists=$state/lists"
        -o "Dir::State::status=$state/status"
        -o "Dir::Cache=$state/cache"
        -o "APT::Default-Release="
        -o "Acquire::Retries=3"
        -o "Acquire::Languages=none"
        -o "Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false"
    )
    if [ "$(id -u)" = 0 ]; then
        # The _apt user cannot enter root's home; say so instead of having apt warn about it.
        apt_opts+=(-o "APT::Sandbox::User=root")
    fi
    apt-get "${apt_opts[@]}" -q --error-on=any update >&2 || return 1  # a failed index download

    local work deb
    work=$(mktemp -d "$cache/fetch.XXXXXX")
    # shellcheck disable=SC2064  # $work expanded now: the trap outlives this function's locals
    trap "rm -rf '$work'" EXIT
    (cd "$work" && apt-get "${apt_opts[@]}" -q download "$package" >&2) || return 1
    deb=$(find "$work" -maxdepth 1 -name "${package}_*.deb" -print -quit)
    [ -n "$deb" ] || { echo "$label: apt-get download left no .deb" >&2; return 1; }
    dpkg-deb -x "$deb" "$work/root"
    if ! "$check" "$work/root/$binary"; then
        echo "$label: $(basename "$deb") does not pass its check; --version says:" >&2
        "$work/root/$binary" --version >&2 || true
        return 1
    fi
    rm -rf "$cache/root"
    mv "$work/root" "$cache/root"
    echo "$bin"
}
