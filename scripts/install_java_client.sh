#!/usr/bin/env bash
# Install what examples/clients/java needs to build offline: protoc, the grpc-java code generator,
# grpc-java and protobuf-java with their runtime dependencies, and the Maven plugins the pom uses,
# all as Debian packages (jars and poms land in /usr/share/maven-repo, which the pom reads).
# Idempotent: a fast no-op when everything is installed. Does nothing (exit 0) when not root or
# without apt-get; a failed install is reported and leaves the Java test to skip, saying why.
set -uo pipefail

PACKAGES=(
    protobuf-compiler protobuf-compiler-grpc-java-plugin
    libgrpc-java libprotobuf-java
    libguava-java libnetty-java libperfmark-java libanimal-sniffer-java libgoogle-gson-java
    liberror-prone-java libjsr305-java libgoogle-common-protos-java
    libmaven-resources-plugin-java libmaven-compiler-plugin-java libmaven-jar-plugin-java
    libmaven-shade-plugin-java libexec-maven-plugin-java libbuild-helper-maven-plugin-java
    libgeronimo-annotation-1.3-spec-java junit5
)
command -v mvn >/dev/null 2>&1 || PACKAGES+=(maven)
command -v javac >/dev/null 2>&1 || PACKAGES+=(default-jdk-headless)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" != "install ok installed" ]; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "install_java_client: the Java example's Debian packages are installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_java_client: no apt-get here; not installing ${missing[*]}"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_java_client: not root; not installing ${missing[*]}"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
for pkg in "${missing[@]}"; do  # refresh the package lists only when one is unknown to them
    if ! apt-cache show "$pkg" >/dev/null 2>&1; then
        apt-get update -q || true
        break
    fi
done
echo "install_java_client: installing ${missing[*]}"
if ! apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    echo "install_java_client: apt-get install failed; the Java client test will skip" >&2
fi
exit 0
