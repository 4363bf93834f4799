plugins {
    id("com.android.application")
}

android {
    namespace = "org.hrmedge.demo"
    compileSdk = 35

    defaultConfig {
        applicationId = "org.hrmedge.demo"
        minSdk = 26 // java.nio.file.Files (MainActivity reads the bundle with it); executorch-android 1.4.1 itself needs 23
        targetSdk = 35
        versionCode = 1
        versionName = "0.1.0"
        ndk { abiFilters += listOf("arm64-v8a", "x86_64") } // the ABIs the ExecuTorch AAR ships
    }
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    // the .pte and the web parity bundle are read as files; keep them uncompressed in the APK
    androidResources { noCompress += listOf("pte", "bin") }
}

dependencies {
    // Pinned to the executorch that wrote the .pte (executorch==1.4.1 in setup.cfg): the runtime must read
    // the program format and carry the kernels (XNNPACK, quantized, llama custom ops) it was lowered to.
    // Coordinates from executorch v1.4.1's extension/android/executorch_android/build.gradle.
    implementation("org.pytorch:executorch-android:1.4.1")
    // the two libraries executorch-android 1.4.1 itself builds against (its Java<->native bridge, .so loading)
    implementation("com.facebook.fbjni:fbjni:0.7.0")
    implementation("com.facebook.soloader:nativeloader:0.10.5")
    testImplementation("junit:junit:4.13.2") // app/src/test: the plain-Java core's tests (also run by pytest)
}
