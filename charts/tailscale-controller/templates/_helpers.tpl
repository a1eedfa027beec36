{{/* An image reference: (list $ .Values.image) -> <imageRegistry>/<repository>:<tag or appVersion>, then
@<digest> when the digest is set (a released chart sets both: the tag says which release, the digest pins it). */}}
{{- define "tsc.image" -}}
{{- $root := index . 0 -}}{{- $img := index . 1 -}}
{{ $root.Values.imageRegistry | trimSuffix "/" }}/{{ $img.repository }}:{{ $img.tag | default $root.Chart.AppVersion }}{{ with $img.digest }}@{{ . }}{{ end }}
{{- end -}}

{{/* Stop before anything is installed when a setting is wrong, naming the value and the fix. */}}
{{- define "tsc.validate" -}}
{{- if not (has .Values.provider (list "headscale" "tailscale" "static")) -}}
{{- fail (printf "provider=%q is not a provider; use headscale, tailscale or static" .Values.provider) -}}
{{- end -}}
{{- if and (eq .Values.provider "headscale") (not .Values.headscale.url) -}}
{{- fail "provider headscale needs headscale.url, the headscale server's URL: --set headscale.url=https://headscale.example.com" -}}
{{- end -}}
{{- if not .Values.imageRegistry -}}
{{- fail "imageRegistry is empty: set it to the registry you pushed both images to (make images REGISTRY=registry.example.com/tailscale TAG=<chart appVersion>), e.g. --set imageRegistry=registry.example.com/tailscale" -}}
{{- end -}}
{{- range $key, $img := dict "image" .Values.image "proxy.image" .Values.proxy.image -}}
{{- if and $img.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" $img.digest)) -}}
{{- fail (printf "%s.digest=%q is not an image digest; use sha256:<64 hex digits> (the index digest the registry reports), or \"\" for the tag alone" $key $img.digest) -}}
{{- end -}}
{{- end -}}
{{- if not (has .Values.ingressScheme (list "auto" "https" "http")) -}}
{{- fail (printf "ingressScheme=%q is not a scheme; use auto, https or http" .Values.ingressScheme) -}}
{{- end -}}
{{- if not (has .Values.proxy.firewallMode (list "" "auto" "iptables" "nftables")) -}}
{{- fail (printf "proxy.firewallMode=%q is not a firewall mode; use auto, iptables or nftables (or \"\")" .Values.proxy.firewallMode) -}}
{{- end -}}
{{- with .Values.dns.stubZoneConfigMap -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$" .) -}}
{{- fail (printf "dns.stubZoneConfigMap=%q is not <namespace>/<name> of a ConfigMap; use e.g. kube-system/coredns, or \"\" to add the stub zone yourself" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* imagePullSecrets ([{name: a}, {name: b}]) as PROXY_IMAGE_PULL_SECRETS wants them: "a,b". */}}
{{- define "tsc.pullSecretNames" -}}
{{- $names := list -}}
{{- range . }}{{ $names = append $names .name }}{{ end -}}
{{ join "," $names }}
{{- end -}}
