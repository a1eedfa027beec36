// Uploads a cast read from stdin to the recorders named on the command line with upstream's client
// (tailscale.com/sessionrecording.ConnectToRecorder), one line at a time, and reports the result.
// With -event first: sends the API request event read from stdin to each recorder named with upstream's
// sessionrecording.SendEvent, and reports each result.
package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"time"

	"tailscale.com/sessionrecording"
)

func sendEvents() {
	event, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Println("read error:", err)
		os.Exit(2)
	}
	var d net.Dialer
	failed := false
	for _, a := range os.Args[2:] {
		err := sessionrecording.SendEvent(netip.MustParseAddrPort(a), bytes.NewReader(event), d.DialContext)
		var unsupported sessionrecording.EventAPINotSupportedErr
		switch {
		case err == nil:
			fmt.Printf("sent %s\n", a)
		case errors.As(err, &unsupported):
			fmt.Printf("unsupported %s %q\n", a, err.Error())
		default:
			fmt.Printf("error %s %q\n", a, err.Error())
			failed = true
		}
	}
	if failed {
		os.Exit(4)
	}
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-event" {
		sendEvents()
		return
	}
	var addrs []netip.AddrPort
	for _, a := range os.Args[1:] {
		addrs = append(addrs, netip.MustParseAddrPort(a))
	}
	var d net.Dialer
	w, attempts, errc, err := sessionrecording.ConnectToRecorder(context.Background(), addrs, d.DialContext)
	for _, at := range attempts {
		fmt.Printf("attempt %s %q\n", at.Recorder, at.FailureMessage)
	}
	if err != nil {
		fmt.Println("connect error:", err)
		os.Exit(2)
	}
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		if _, err := w.Write(append(sc.Bytes(), '\n')); err != nil {
			fmt.Println("write error:", err)
			os.Exit(3)
		}
		time.Sleep(10 * time.Millisecond)
	}
	w.Close()
	select {
	case err := <-errc:
		if err != nil {
			fmt.Println("upload error:", err)
			os.Exit(4)
		}
	case <-time.After(30 * time.Second):
		fmt.Println("no result")
		os.Exit(5)
	}
	fmt.Println("uploaded")
}
